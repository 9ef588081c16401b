"""Terminal rendering of the roofline summary (rich tables)."""
from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table

from .model import SCHEDULES
from .schedules import Schedule

# byte terms grouped into the columns a reader compares
GROUPS = {"Q": ("q_read", "q_l2_miss_reread"), "K/V": ("kv_read", "kv_l2_miss_reread"),
          "partial O": ("partial_write", "partial_read"), "stats": ("stats_write", "stats_read"),
          "index": ("index",), "out": ("out_write",)}


def _fmt_r(x):
    return "never (for any reuse)" if x is None else f"{x:.3f}"


def _fmt_u(u) -> str:
    return "never" if u is None else "always" if u == "always" else f"{u:.2f}"


def print_roofline(summary: dict, console: Console | None = None) -> None:
    con = console or Console()
    sh = summary["shape"]
    con.print(f"[bold]Device[/bold] {summary['device']}: HBM {summary['hbm_bytes_per_s'] / 1e12:.2f} TB/s, "
              f"L2 {summary['l2_bytes_per_s'] / 1e12:.2f} TB/s  ({summary['device_source']})")
    con.print(f"[bold]Shape[/bold] Hq {sh['hq']}, Hkv {sh['hkv']}, D {sh['head_dim']}, block {sh['block']}, "
              f"top-{sh['topk']}, data {sh['dtype']}, partials {sh['partial_dtype']}")
    con.print(f"[bold]Predicted crossover[/bold]: KV-outer is faster than Q-outer while nsb/N < "
              f"[bold green]{_fmt_r(summary['crossover_nsb_per_n'])}[/bold green] "
              f"(bandwidth roofline; numeric check {_fmt_r(summary['crossover_nsb_per_n_numeric'])}); "
              f"MSA-style scatter vs Q-outer: {_fmt_r(summary['crossover_msa_scatter_nsb_per_n'])}")
    con.print(f"With Q-outer's L2 capacity misses at N = {summary['n_tokens']}: nsb/N < "
              f"{_fmt_r(summary['crossover_nsb_per_n_l2_capacity'])}")
    packed = summary["q_packed_beats_kv_outer_below_union_ratio"]
    con.print(f"[bold]q-packed beats KV-outer[/bold] at nsb/N {packed['nsb_per_n']:g}, N = {summary['n_tokens']} "
              "below union_ratio (P = 8): " + ", ".join(f"{d} {_fmt_u(u)}" for d, u in packed["by_dtype"].items()))

    table = Table(title=f"Bytes per query token at nsb = 0; K/V adds nsb/N x "
                        f"{summary['kv_block_bytes_per_unit_reuse']:,} B at HBM (and at L2 for the KV-outer schedules)",
                  box=box.SQUARE, padding=(0, 0), show_edge=False)     # 75 columns: whole numbers at 80
    table.add_column("schedule")
    table.add_column("level")
    for g in list(GROUPS) + ["total"]:
        table.add_column(g, justify="right")
    for s in SCHEDULES:
        for lvl in ("hbm", "l2"):
            terms = summary["per_query_token_bytes"][s][lvl]
            cells = [f"{sum(terms.get(t, 0) for t in names):,.0f}" for names in GROUPS.values()]
            table.add_row(s, lvl.upper(), *cells, f"{sum(terms.values()):,.0f}")
    con.print(table)

    pts = Table(title=f"Predicted launch at N = {summary['n_tokens']} query tokens (L2-capacity aware)")
    for col in ("nsb/N", "schedule", "time (us)", "TFLOP/s", "bound by", ""):
        pts.add_column(col, justify="right" if col in ("nsb/N", "time (us)", "TFLOP/s") else "left")
    for row in summary["reuse_points"]:
        for i, s in enumerate(SCHEDULES):
            p = row[s]
            pts.add_row(f"{row['nsb_per_n']:g}" if i == 0 else "", s, f"{p['time_s'] * 1e6:,.1f}",
                        f"{p['tflops']:.0f}", p["binding"], "fastest" if row["faster"] == s else "",
                        end_section=(i == len(SCHEDULES) - 1))
    con.print(pts)


SHORT = {Schedule.KV_OUTER: "KV", Schedule.Q_OUTER: "Q", Schedule.Q_PACKED: "QP"}


def print_co_selection(summary: dict, console: Console | None = None) -> None:
    """The predicted winner per (reuse, co-selection) cell with its useful TFLOP/s, within 80 columns."""
    from rich import box
    con = console or Console()
    co = summary["co_selection"]
    p = co["tile_tokens"]
    table = Table(box=box.SIMPLE_HEAD, title=f"Predicted winner at N = {co['n_tokens']}, "
                                              f"{summary['shape']['dtype']}: schedule and useful TFLOP/s",
                  caption=f"u: union_ratio at P = {p} tokens per tile (distinct blocks a tile selects over "
                          "the blocks one token selects; 1: its tokens select alike). KV = kv-outer, "
                          "Q = q-outer, QP = q-packed (token-packed Q-outer); -: this reuse needs a larger u. "
                          "QP < u: q-packed beats kv-outer below this u.")
    table.add_column("nsb/N", justify="right")
    for u in co["union_ratios"]:
        table.add_column(f"u {u:g}", justify="right")
    table.add_column("QP < u", justify="right")
    for row in co["rows"]:
        cells = [f"{SHORT.get(c['winner'], c['winner'])} {c['tflops']:.0f}" if c["feasible"] else "-"
                 for c in row["cells"]]
        verdict = row["q_packed_beats_kv_outer"]
        cross = (f"{row['q_packed_beats_kv_outer_below_union_ratio']:.2f}" if verdict == "below"
                 else "never" if verdict == "never" else f"all <= {p}")
        table.add_row(f"{row['nsb_per_n']:g}", *cells, cross)
    con.print(table)


"""`auto`: plan each workload with the schedule (or split) the roofline model predicts fastest.

Candidates: KV-outer (the CuTe stage where its libraries are built, else Triton), q-packed (its CuTe stage
where built, else Triton) and the hybrid split. Their statistics come from the workload itself: reuse,
selected blocks, useful FLOPs, and for the packed candidates the union their own planner builds (so the
prediction uses the union ratio the kernel would execute). Each prediction is the roofline time over the
fraction of it the candidate's kernel reaches on this device, where the device profile carries a measured
one (`DeviceProfile.achieved`, "backend/dtype" -> fraction; 1 where none is measured). The plan records
every prediction and the pick under "auto", and the schedule it runs under "schedule".
"""
from __future__ import annotations

import torch

from ..roofline.hybrid import min_shared_tokens
from ..roofline.model import PACKED, predict
from ..scenarios.stats import selected_pairs, useful_flops
from ..scenarios.workload import Workload
from .base import Backend, BackendUnavailable, Plan, get_backend, register
from .kv_outer.config import model_shape
from .q_packed.hybrid import achieved, device_profile
from .q_packed.schedule import PackedSchedule

TILE_TOKENS = 8


def first_available(names: tuple[str, ...], dtype: str, device, w: Workload | None = None) -> Backend | None:
    """The first of `names` that is registered and runs here (given the workload: runs it)."""
    for name in names:
        try:
            backend = get_backend(name)
        except KeyError:
            continue
        reason = backend.unavailable_reason(dtype, device) if w is None else backend.workload_unavailable_reason(w)
        if reason is None:
            return backend
    return None


@register("auto")
class AutoBackend(Backend):
    name = "auto"
    description = "the schedule or split the roofline model predicts fastest for the workload"
    dtypes = ("bf16", "fp8", "fp16", "fp32")
    KV_OUTER = ("kv-outer-cute", "kv-outer")
    Q_PACKED = ("q-packed-cute", "q-packed")

    def unavailable_reason(self, dtype, device):
        reason = super().unavailable_reason(dtype, device)
        if reason is None and first_available(self.KV_OUTER + self.Q_PACKED, dtype, device) is None:
            reason = get_backend("kv-outer").unavailable_reason(dtype, device)
        return reason

    def candidates(self, w: Workload) -> dict[str, tuple[Backend, float, dict]]:
        """name -> (backend, predicted seconds, what the prediction used), for every candidate that runs here."""
        s, dev = w.shape, w.device
        profile = device_profile(dev)
        dtype = w.dtype if w.dtype in ("bf16", "fp8") else "bf16"
        n = w.n_tokens
        valid = w.selection >= 0
        selected = float(valid.sum())
        per_query = selected / (n * s.hkv) if n else 0.0
        nsb = float(selected_pairs(w)[1].numel())
        flops = useful_flops(w)
        out = {}
        kv = first_available(self.KV_OUTER, w.dtype, dev, w)
        if kv is not None:
            # the launch configuration the KV-outer plan would take (tile order, query ranges), as the sweep's model
            shape = model_shape(s.hq, s.hkv, s.head_dim, s.block, s.topk, dtype, kv.resolved_config(w).__dict__)
            p = predict("kv-outer", shape, n, nsb, profile, per_query, flops)
            out["kv-outer"] = (kv, p.time_s / achieved(profile, kv.name, dtype), {"roofline_s": p.time_s})
        qp = first_available(self.Q_PACKED, w.dtype, dev, w)
        if qp is not None:
            shape = model_shape(s.hq, s.hkv, s.head_dim, s.block, s.topk, dtype, None)
            sch = PackedSchedule(w, TILE_TOKENS)
            sch()
            executed = float(sch.tile_count.double() @ sch.tile_ntok.double().repeat(s.hkv))
            ratio = executed / selected if selected else 1.0
            p = predict(PACKED, shape, n, nsb, profile, per_query, flops, union_ratio=ratio, tile_tokens=TILE_TOKENS)
            out["q-packed"] = (qp, p.time_s / achieved(profile, qp.name, dtype),
                               {"roofline_s": p.time_s, "union_ratio": ratio})
            if kv is not None:
                out["hybrid"] = self.hybrid_candidate(w, shape, profile, dtype, kv, qp, flops, selected)
        if not out:
            raise BackendUnavailable(f"{self.name}: no candidate schedule runs here")
        return out

    def hybrid_candidate(self, w, shape, profile, dtype, kv, qp, flops, selected):
        """The split at the model's threshold: the packed part's roofline plus the residual's KV-outer one."""
        s, n = w.shape, w.n_tokens
        share = min_shared_tokens(shape, profile, TILE_TOKENS, achieved(profile, qp.name, dtype),
                                  achieved(profile, kv.name, dtype))
        sch = PackedSchedule(w, TILE_TOKENS, min_share=share, residual=True)
        sch()
        res = sch.residual_pages
        residual = float((res >= 0).sum())
        packed = selected - residual
        executed = float(sch.tile_count.double() @ sch.tile_ntok.double().repeat(s.hkv))
        head = torch.arange(s.hkv, device=res.device).view(-1, 1, 1) * w.num_pages
        nsb_res = float(torch.unique((res + head)[res >= 0]).numel())
        tiles = sch.tile_page.view(s.hkv, -1)
        nsb_packed = float(torch.unique((tiles + head.view(-1, 1))[tiles >= 0]).numel())
        t = 0.0
        if packed > 0:
            p = predict(PACKED, shape, n, nsb_packed, profile, packed / (n * s.hkv), flops * packed / selected,
                        union_ratio=executed / packed, tile_tokens=TILE_TOKENS)
            t += p.time_s / achieved(profile, qp.name, dtype)
        if residual > 0:
            kv_shape = model_shape(s.hq, s.hkv, s.head_dim, s.block, s.topk, dtype, kv.resolved_config(w).__dict__)
            p = predict("kv-outer", kv_shape, n, nsb_res, profile, residual / (n * s.hkv), flops * residual / selected)
            t += p.time_s / achieved(profile, kv.name, dtype)
        backend = get_backend(f"hybrid@m{share}+{'cute' if kv.name == 'kv-outer-cute' else 'triton'}")
        return backend, t, {"min_share": share, "packed_entry_share": packed / selected if selected else 0.0}

    def _plan(self, w: Workload) -> Plan:
        cands = self.candidates(w)
        pick = min(cands, key=lambda k: cands[k][1])        # ties: the first, a whole schedule before the split
        backend = cands[pick][0]
        plan = backend.plan(w)
        plan.info = {**plan.info, "schedule": PACKED if pick == "q-packed" else pick,
                     "auto": {"picked": pick, "backend": backend.name,
                              "predicted_s": {k: v[1] for k, v in cands.items()},
                              "used": {k: v[2] for k, v in cands.items()}}}
        plan.backend = self.name
        return plan

"""msa-bench: benchmark and roofline harness for top-k block-sparse attention."""
__version__ = "0.1.0"

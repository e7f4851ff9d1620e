"""Why distribute at all: the compute and memory of training one large model.

* compute: ``6·P·D`` floating-point operations to train P parameters on D tokens
  (forward 2·P·D, backward 4·P·D; Kaplan et al. 2020, §2.1), and the GPU-years that takes;
* memory: model states at ``bytes_per_param`` (2 for fp16 weights alone, 16 with
  mixed-precision Adam: Rajbhandari et al. 2019, see ``cost.data_parallel``).

GPT-3 (Brown et al. 2020): 175e9 parameters, 300e9 training tokens, 3.14e23 FLOP
reported. Peak dense fp16/bf16 tensor throughput from the vendors' data sheets: V100
125 TFLOP/s, A100 312 TFLOP/s, H100 SXM 989 TFLOP/s. Real training sustains a fraction
of peak ("model FLOPs utilisation", typically 30-50%).
"""
from __future__ import annotations

GPT3_PARAMS = 175e9
GPT3_TOKENS = 300e9
PEAK_TFLOPS = {"V100": 125.0, "A100": 312.0, "H100": 989.0}
SECONDS_PER_YEAR = 365.25 * 24 * 3600


def training_flops(params: float, tokens: float) -> float:
    """Floating-point operations to train ``params`` parameters on ``tokens`` tokens: 6·P·D."""
    return 6.0 * params * tokens


def gpu_years(flops: float, peak_tflops: float, utilisation: float = 0.4) -> float:
    """Years one GPU needs for ``flops`` at ``utilisation`` of its peak throughput."""
    if not 0 < utilisation <= 1:
        raise ValueError(f"utilisation must be in (0, 1], got {utilisation!r}")
    return flops / (peak_tflops * 1e12 * utilisation) / SECONDS_PER_YEAR


def model_bytes(params: float, bytes_per_param: float) -> float:
    """Bytes of ``params`` parameters at ``bytes_per_param`` each (2: fp16 weights; 16: + Adam)."""
    return params * bytes_per_param

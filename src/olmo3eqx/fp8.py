"""FP8 projections (model.fp8) as AI2 trained OLMo 3 7B's stage 3: torchao's float8 training linears, in XLA's form.

AI2's stage 3 (OLMo-core, src/scripts/official/OLMo3/OLMo-3-1025-7B-long-context.py) sets
`Float8Config(enabled=True, ao=AOFloat8LinearConfig.recommended())`: torchao's `Float8LinearConfig` with its default
casts (dynamic tensorwise scaling, e4m3 for the input and the weight, e5m2 for the output's gradient) and
`round_scales_to_power_of_2=True`. OLMo-core's `Transformer.apply_fp8` converts every `nn.Linear` whose dimensions are
all multiples of 16 except the LM head (`lm_head.w_out` is ignored); the embedding is no linear. Here: each block's
q/k/v/o and MLP projections (model.Linear, marked by model.with_fp8). Stages 1 and 2 ran without FP8.

Each of a linear's three GEMMs (output x w, grad input g w^T, grad weight x^T g) takes its operands cast to FP8 by
torchao's dynamic rule (torchao/float8/float8_utils.py): amax = max |a| over the scaling group, scale = fp8_max /
max(amax, 1e-12) in float32, rounded down to a power of 2, a_fp8 = convert(clamp(a * scale, -fp8_max, fp8_max)); the
product is divided by both scales (cuBLASLt accumulates in float32).
- tensorwise: one scale per tensor; e4m3 for inputs and weights, e5m2 for gradients (AI2's stage 3).
- rowwise (torchao's "rowwise" recipe): one scale per row of each operand along the GEMM's contracting dimension
  (x per token in the output GEMM, per feature in the grad-weight GEMM); e4m3 everywhere; power-of-2 scales.
What torchao also does and this does not: AI2's run all-gathered the weights in FP8 under FSDP (its scale
precomputed once a step); here weights are gathered in the compute dtype (olmo3eqx.precision) and cast after. And
under GSPMD an amax over a sharded tensor is the whole tensor's (one small all-reduce), where torchao takes each
rank's own.

The XLA form: a dot of the two FP8 operands with a result in the compute dtype, multiplied after by the inverse scales
(powers of 2, so the same numbers as scaling before the rounding). XLA:GPU (jaxlib 0.10.2) compiles each such dot,
forward and backward, to cuBLASLt's FP8 GEMM (custom call `__cublas$lt$matmul$f8`, a tensorwise scale folded into its
operand scale) when Triton GEMMs are off (`xla_gpu_enable_triton_gemm=false`), and to a Triton GEMM fusion on the FP8
operands with them on (XLA's default; an ahead-of-time compile cannot autotune between the two). Dequantizing the
operands before a high-precision dot instead, the other pattern XLA's rewriter knows, is lost with Triton on: the
dequantize becomes its own fusion and the GEMM runs in bfloat16. tests/test_fp8.py reads both programs, compiled for
an H100. On CPU the same program computes the same rounding in software (the losses' test).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2
GRAD_DTYPE = {"tensorwise": E5M2, "rowwise": E4M3}
"""The dtype of the output's gradient in both backward GEMMs (torchao: e5m2 by default, e4m3 in the rowwise recipe)."""
EPS = 1e-12
"""torchao's floor on amax (float8_utils.EPS), so an all-zero tensor gets a finite scale."""
OUTPUT_NAME = "fp8_dot"
"""checkpoint_name of every FP8 projection's output: the remat policies that keep matmul outputs keep these too
(model.remat_policy), which they cannot see as matmuls inside the custom VJP."""
MULTIPLE = 16
"""OLMo-core converts a linear only when every dimension of its weight is a multiple of this (cuBLASLt's FP8 GEMMs
want it too); model.with_fp8 leaves the others in the compute dtype."""


def scale(a: Float[Array, "*shape"], dtype, axis: int | None) -> Float[Array, "*scale"]:
    """torchao's dynamic scale of `a` for FP8 `dtype`: fp8_max / max(amax, EPS) in float32, rounded down to a power of
    2; amax over the whole tensor (`axis` None) or along `axis` (kept, size 1). No gradient flows through it (torchao
    computes it under no_grad)."""
    a = jax.lax.stop_gradient(a)
    amax = jnp.max(jnp.abs(a.astype(jnp.float32)), axis=axis, keepdims=axis is not None)
    s = jnp.float32(jnp.finfo(dtype).max) / jnp.maximum(amax, EPS)
    _, exponent = jnp.frexp(s)  # s = m 2^e with m in [0.5, 1): 2^floor(log2 s) = 2^(e-1), exact (log2 may not be)
    return jnp.ldexp(jnp.float32(1), exponent - 1)


def quantize(a: Float[Array, "*shape"], dtype, axis: int | None) -> tuple[Array, Float[Array, "*scale"]]:
    """(a cast to FP8 `dtype` by torchao's rule, its scale): convert(clamp(a * scale, +-fp8_max))."""
    s = scale(a, dtype, axis)
    top = jnp.float32(jnp.finfo(dtype).max)
    return jnp.clip(a.astype(jnp.float32) * s, -top, top).astype(dtype), s


def gemm(a: Float[Array, "m k"], b: Float[Array, "k n"], a_dtype, b_dtype, recipe: str, out_dtype
         ) -> Float[Array, "m n"]:
    """a @ b in `out_dtype`, each operand cast to FP8 (`a_dtype`, `b_dtype`) with scales along the contracting
    dimension as `recipe` says, the product accumulated in float32 and divided by the scales."""
    axes = (None, None) if recipe == "tensorwise" else (1, 0)
    a8, sa = quantize(a, a_dtype, axes[0])
    b8, sb = quantize(b, b_dtype, axes[1])
    y = jax.lax.dot_general(a8, b8, (((1,), (0,)), ((), ())), preferred_element_type=out_dtype)
    # Power-of-2 scales: dividing after the rounding to out_dtype is exact, the same numbers as dividing before it.
    return y * ((1 / sa) * (1 / sb)).astype(out_dtype)


def forward(x: Float[Array, "n din"], w: Float[Array, "din dout"], recipe: str) -> Float[Array, "n dout"]:
    """The output GEMM x w: both operands e4m3."""
    return gemm(x, w, E4M3, E4M3, recipe, x.dtype)


def grad_input(g: Float[Array, "n dout"], w: Float[Array, "din dout"], recipe: str) -> Float[Array, "n din"]:
    """The input's gradient g w^T: the gradient in GRAD_DTYPE, the weight in e4m3 (scaled along dout)."""
    return gemm(g, w.T, GRAD_DTYPE[recipe], E4M3, recipe, g.dtype)


def grad_weight(x: Float[Array, "n din"], g: Float[Array, "n dout"], recipe: str, out_dtype
                ) -> Float[Array, "din dout"]:
    """The weight's gradient x^T g in `out_dtype`: the input in e4m3, the gradient in GRAD_DTYPE (both scaled along
    the rows n they contract over)."""
    return gemm(x.T, g, E4M3, GRAD_DTYPE[recipe], recipe, out_dtype)


def matmul(x: Float[Array, "n din"], w: Float[Array, "din dout"], recipe: str) -> Float[Array, "n dout"]:
    """x @ w with all three GEMMs in FP8 (`recipe` tensorwise or rowwise), as torchao's Float8Linear: the backward
    casts its operands from the high-precision x and w it kept, as torchao's does."""

    @jax.custom_vjp
    def run(x, w):
        return forward(x, w, recipe)

    def backward(res, g):
        x, w = res
        return grad_input(g, w, recipe), grad_weight(x, g, recipe, w.dtype)

    run.defvjp(lambda x, w: (run(x, w), (x, w)), backward)
    return checkpoint_name(run(x, w), OUTPUT_NAME)

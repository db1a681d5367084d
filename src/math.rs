//! Element-wise math written branch-free, so that the loops over it vectorise: the attention's
//! softmax and the MLP's activations call it per element, where libm's scalar calls (`expf`,
//! `tanhf`) took a fifth of a prefill's time. Every operation in it is exactly rounded
//! (`mul_add` is one fused rounding on every target), so a value's bits do not depend on the
//! instructions that computed it or on its lane: rows stay bit-identical in any batch.

/// The gated MLP's activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Activation {
    /// `silu(gate) * up` (SwiGLU).
    Silu,
    /// `gelu_tanh(gate) * up` (GeGLU with the tanh approximation).
    GeluTanh,
    /// gpt-oss's: `g * sigmoid(1.702 g) * (u + 1)`, with the gate `g` clamped to at most 7
    /// and the up `u` to [-7, 7].
    ClampedSwiglu,
}

/// `e^x`: range reduction `x = n ln 2 + r` with `|r| <= ln 2 / 2`, a degree-6 polynomial for
/// `e^r` (relative error below 2e-7), and `2^n` built in the exponent bits. `n` is rounded by
/// adding `1.5 · 2^23`, which leaves it in the low mantissa bits, so no float-to-int conversion
/// (scalar in Rust, which saturates) is needed. Exactly 0 for `x < -87` (including -inf);
/// `e^88` (3.4e38's neighbour, finite) for every `x >= 88`.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    const ROUND: f32 = 12_582_912.0;
    let xc = x.clamp(-87.0, 88.0);
    let t = xc.mul_add(LOG2E, ROUND);
    let n = t - ROUND;
    let r = xc - n * LN2_HI - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    // `t`'s bits are `ROUND`'s plus `n`, so these are `(n + 127) << 23` for -126 <= n <= 127.
    let scale = f32::from_bits(t.to_bits().wrapping_sub(ROUND.to_bits()).wrapping_add(127) << 23);
    if x < -87.0 {
        0.0
    } else {
        p * scale
    }
}

/// `x · σ(y) = x / (1 + e^-y)`: SiLU is `x · σ(x)`, and the tanh form of GELU is
/// `x · σ(2z)` (`(1 + tanh z) / 2 = σ(2z)`). 0 (of `x`'s sign) when `e^-y` is past f32's range.
#[inline(always)]
pub(crate) fn times_sigmoid(x: f32, y: f32) -> f32 {
    x / (1.0 + exp(-y))
}

#[cfg(test)]
mod tests {
    #[test]
    fn exp_matches_libm() {
        let mut worst = 0f32;
        let mut x = -87.0f32;
        while x <= 88.0 {
            let (a, b) = (super::exp(x), x.exp());
            worst = worst.max((a - b).abs() / b);
            x += 0.01;
        }
        assert!(worst < 5e-7, "relative error {worst}");
        assert_eq!(super::exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(super::exp(-1e30), 0.0);
        assert_eq!(super::exp(0.0), 1.0);
        assert!(super::exp(f32::INFINITY).is_finite());
    }

    #[test]
    fn times_sigmoid_matches_f64() {
        let mut worst = 0f64;
        let mut y = -100.0f32;
        while y <= 100.0 {
            let want = 1.5 / (1.0 + (-f64::from(y)).exp());
            let got = f64::from(super::times_sigmoid(1.5, y));
            worst = worst.max((got - want).abs() / want.max(1e-30));
            y += 0.013;
        }
        assert!(worst < 1e-6, "relative error {worst}");
        assert_eq!(super::times_sigmoid(2.0, 1e4), 2.0);
    }
}

//! The packed matmul against an f64 reference, bit-exact f32 weights, batch invariance and
//! agreement of every instruction path this CPU has.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};

use super::quant::QK;
use super::*;
use crate::model::gguf::GgufType::{self, Ggml, Mxfp4};

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// MXFP4 blocks of `[n, k]` (random codes, exponents for weights of magnitude up to 3/4), with
/// the f32 values they stand for, from the E2M1 definition (sign, 2 exponent bits, 1 mantissa
/// bit) rather than from the kernel's table.
fn mxfp4_blocks(n: usize, k: usize, seed: u64) -> (Vec<u8>, Vec<f32>) {
    let e2m1 = |q: u8| {
        let (sign, exp, man) = (q >> 3, (q >> 1) & 3, f32::from(q & 1));
        let mag = match exp {
            0 => man * 0.5,
            e => (1.0 + man * 0.5) * f32::powi(2.0, i32::from(e) - 1),
        };
        if sign == 1 {
            -mag
        } else {
            mag
        }
    };
    let noise = values(n * k / QK * 17, seed);
    let mut bytes = Vec::new();
    let mut w = vec![0f32; n * k];
    for (b, block) in noise.chunks(17).enumerate() {
        let e = 118 + ((block[0] + 1.0) * 3.5) as u8;
        bytes.push(e);
        for j in 0..16 {
            let q = ((block[j + 1] + 1.0) * 128.0) as u8;
            bytes.push(q);
            let scale = f32::powi(2.0, i32::from(e) - 127);
            w[b * QK + j] = e2m1(q & 0x0F) * scale;
            w[b * QK + j + 16] = e2m1(q >> 4) * scale;
        }
    }
    (bytes, w)
}

/// Weights of `[n, k]` packed from `dtype`, with the f32 values they stand for.
fn weights(n: usize, k: usize, dtype: GgufType, seed: u64) -> (PackedLinear, Vec<f32>) {
    let w = Tensor::from_vec(values(n * k, seed), (n, k), &Device::Cpu).unwrap();
    let dtype = match dtype {
        Ggml(t) => t,
        Mxfp4 => {
            let (bytes, w) = mxfp4_blocks(n, k, seed);
            let lin = PackedLinear::from_gguf(Mxfp4, n, k, &mut |at, len, buf| {
                buf.clear();
                buf.extend_from_slice(&bytes[at..at + len]);
                Ok(())
            });
            return (lin.unwrap(), w);
        }
    };
    match dtype {
        GgmlDType::F32 => {
            let v = w.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            (PackedLinear::from_f32(&v, n, k).unwrap(), v)
        }
        _ => {
            let q = QTensor::quantize(&w, dtype).unwrap();
            let v = q.dequantize(&Device::Cpu).unwrap().flatten_all().unwrap();
            (
                PackedLinear::from_qtensor(&q).unwrap(),
                v.to_vec1::<f32>().unwrap(),
            )
        }
    }
}

const SHAPES: [(usize, usize, GgufType); 20] = [
    // 19 panels: work items of several panels.
    (300, 64, Ggml(GgmlDType::Q4_1)),
    (33, 64, Ggml(GgmlDType::Q4_1)),
    (16, 96, Ggml(GgmlDType::Q4_1)),
    (40, 32, Ggml(GgmlDType::Q8_0)),
    (7, 64, Ggml(GgmlDType::Q8_0)),
    (40, 64, Ggml(GgmlDType::Q4_0)),
    (33, 96, Ggml(GgmlDType::Q5_0)),
    (20, 64, Ggml(GgmlDType::Q5_1)),
    (35, 256, Ggml(GgmlDType::Q4K)),
    (17, 512, Ggml(GgmlDType::Q5K)),
    (40, 256, Ggml(GgmlDType::Q6K)),
    (3, 512, Ggml(GgmlDType::Q6K)),
    (17, 40, Ggml(GgmlDType::F32)),
    (5, 7, Ggml(GgmlDType::F32)),
    (17, 40, Ggml(GgmlDType::F16)),
    (21, 33, Ggml(GgmlDType::BF16)),
    // Kept as f32 (dequantized): the K-quants the integer kernel has no form for.
    (18, 256, Ggml(GgmlDType::Q3K)),
    (18, 256, Ggml(GgmlDType::Q2K)),
    (33, 64, Mxfp4),
    (16, 96, Mxfp4),
];

/// The formats, on shapes every one of them takes.
const FORMATS: [GgufType; 13] = [
    Ggml(GgmlDType::Q4_0),
    Ggml(GgmlDType::Q4_1),
    Ggml(GgmlDType::Q5_0),
    Ggml(GgmlDType::Q5_1),
    Ggml(GgmlDType::Q8_0),
    Ggml(GgmlDType::Q4K),
    Ggml(GgmlDType::Q5K),
    Ggml(GgmlDType::Q6K),
    Ggml(GgmlDType::F32),
    Ggml(GgmlDType::F16),
    Ggml(GgmlDType::BF16),
    Ggml(GgmlDType::Q3K),
    Mxfp4,
];

/// Whether `dtype` runs on the float kernel (its only rounding is f32's).
fn is_float(dtype: GgufType) -> bool {
    matches!(
        dtype,
        Ggml(GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16 | GgmlDType::Q2K | GgmlDType::Q3K)
    )
}

/// The activations the integer kernel sees: each 32-value block rounded to 255 levels of
/// `max|x| / 127` (what `QuantRows` stores, written out independently here).
fn quantized_activations(x: &[f32]) -> Vec<f64> {
    x.chunks(QK)
        .flat_map(|b| {
            let amax = b.iter().fold(0f32, |a, v| a.max(v.abs()));
            let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
            let s = (amax / 127.0) as f64;
            b.iter()
                .map(move |&v| (v * inv).round_ties_even() as f64 * s)
                .collect::<Vec<_>>()
        })
        .collect()
}

#[test]
fn matches_the_f64_reference() {
    for isa in Isa::available() {
        for (i, &(n, k, dtype)) in SHAPES.iter().enumerate() {
            let (lin, w) = weights(n, k, dtype, i as u64);
            for m in [0, 1, 2, 5, 6, 7, 13, 100] {
                let x = values(m * k, 100 + m as u64);
                // The integer kernel's only approximation is its activations; the f32 kernel
                // has none but rounding.
                let xq = if is_float(dtype) {
                    x.iter().map(|&v| v as f64).collect()
                } else {
                    quantized_activations(&x)
                };
                let y = lin.matmul(&x, m, None, isa);
                assert_eq!(y.len(), m * n);
                for r in 0..m {
                    for c in 0..n {
                        let want: f64 = (0..k).map(|j| xq[r * k + j] * w[c * k + j] as f64).sum();
                        let exact: f64 = (0..k)
                            .map(|j| x[r * k + j] as f64 * w[c * k + j] as f64)
                            .sum();
                        let got = y[r * n + c] as f64;
                        assert!(
                            (got - want).abs() <= 1e-5 * (1.0 + want.abs()) * k as f64,
                            "{isa:?} {dtype:?} m={m} n={n} k={k} [{r}][{c}]: {got} vs {want}"
                        );
                        // 8-bit activations move a dot of k terms in [-1, 1] by well under 1%
                        // of k.
                        assert!((got - exact).abs() <= 0.01 * k as f64, "{got} vs {exact}");
                    }
                }
            }
        }
    }
}

#[test]
fn float_weights_are_used_bit_exact() {
    // x = the identity: row j of y is column j of W, computed as 1 · w plus exact zeros (a
    // weight of -0 comes out +0).
    for isa in Isa::available() {
        for (i, &(n, k, dtype)) in SHAPES.iter().enumerate() {
            if !is_float(dtype) {
                continue;
            }
            let (lin, w) = weights(n, k, dtype, i as u64);
            let mut eye = vec![0f32; k * k];
            for j in 0..k {
                eye[j * k + j] = 1.0;
            }
            let y = lin.matmul(&eye, k, None, isa);
            for j in 0..k {
                for c in 0..n {
                    assert_eq!(
                        y[j * n + c].to_bits(),
                        (w[c * k + j] + 0.0).to_bits(),
                        "{isa:?} {dtype:?}"
                    );
                }
            }
        }
    }
}

#[test]
fn a_row_is_bit_identical_alone_and_in_any_batch() {
    // 200 rows: more than one chunk of rows per work item.
    let (n, k, total) = (300, 256, 200);
    let x = values(total * k, 7);
    for isa in Isa::available() {
        for dtype in FORMATS {
            let (lin, _) = weights(n, k, dtype, 3);
            let all = lin.matmul(&x, total, None, isa);
            for size in [1, 2, 3, 6, 7, 13, 64, 97, 200] {
                for start in [0, total - size, (total - size) / 2] {
                    let part = lin.matmul(&x[start * k..(start + size) * k], size, None, isa);
                    assert_eq!(
                        part.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        all[start * n..(start + size) * n]
                            .iter()
                            .map(|v| v.to_bits())
                            .collect::<Vec<_>>(),
                        "{isa:?} {dtype:?}: rows {start}..+{size}"
                    );
                }
            }
        }
    }
}

#[test]
fn every_instruction_path_gives_the_same_bits() {
    // Two tiles of 16 rows (AMX's unit) and 5 rows more.
    let (n, k, m) = (50, 512, 37);
    let x = values(m * k, 9);
    for dtype in FORMATS {
        let (lin, _) = weights(n, k, dtype, 5);
        let scalar = lin.matmul(&x, m, None, Isa::Scalar);
        for isa in Isa::available() {
            let y = lin.matmul(&x, m, None, isa);
            assert!(
                y.iter()
                    .zip(&scalar)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{isa:?} {dtype:?} differs from the scalar path"
            );
        }
    }
}

/// CI names the path its machine must have (`PENSIEVE_EXPECT_ISA=Neon` under qemu, `Avx2` on
/// x86-64), so that a detection that stops finding it fails here rather than leaving the tests
/// above on the scalar path alone.
#[test]
fn the_expected_instruction_path_is_detected() {
    if let Ok(name) = std::env::var("PENSIEVE_EXPECT_ISA") {
        let found: Vec<String> = Isa::available().iter().map(|i| format!("{i:?}")).collect();
        assert!(found.contains(&name), "{name} is not among {found:?}");
    }
}

#[test]
fn rows_are_the_dequantized_weights() {
    for (i, &(n, k, dtype)) in SHAPES.iter().enumerate() {
        let (lin, w) = weights(n, k, dtype, i as u64);
        let picks: Vec<u32> = [0, n / 2, n - 1].map(|r| r as u32).to_vec();
        let rows = lin.rows(&picks).unwrap();
        for (j, &r) in picks.iter().enumerate() {
            for c in 0..k {
                let (got, want) = (rows[j * k + c], w[r as usize * k + c]);
                // A fused multiply-add where candle rounds twice.
                assert!(
                    (got - want).abs() <= 1e-6 * (1.0 + want.abs()),
                    "{dtype:?} row {r} [{c}]: {got} vs {want}"
                );
            }
        }
    }
    let (lin, _) = weights(5, 32, Ggml(GgmlDType::Q8_0), 1);
    assert!(lin.rows(&[5]).is_err(), "a row past the matrix");
}

/// A packed matrix takes about the bytes of its file: codes at their own width, factors as
/// the file keeps them.
#[test]
fn packed_bytes_are_about_the_file_bytes() {
    let (n, k) = (64, 1024);
    for dtype in FORMATS {
        let (lin, _) = weights(n, k, dtype, 2);
        let file = n * k / dtype.block_size() * dtype.type_size();
        let ratio = lin.bytes() as f64 / file as f64;
        let bound = match dtype {
            Ggml(GgmlDType::Q2K | GgmlDType::Q3K) => 32.0 / 2.5,
            // f16 factors of 32 values where the file has 16 bytes of codes: one f16 more.
            Ggml(GgmlDType::Q4_0 | GgmlDType::Q5_0 | GgmlDType::Q8_0) => 1.12,
            _ => 1.06,
        };
        assert!(ratio <= bound, "{dtype:?}: {ratio:.3} of the file's bytes");
    }
}

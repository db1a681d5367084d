//! The step's fused kernels (`kernels/step.cu`: the GPU pass's add + norm, activation, and
//! RoPE with the KV write; the write of 8- and 4-bit codes) run by the emulator, against what
//! they replace computed in f64 from the same inputs (the codes: the CPU's bytes), under every
//! schedule; and their deliberately broken copies
//! (`kernels/emu/mutants`) caught. No GPU needed.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use candle_core::{DType, Device, Tensor};
use pensieve::attention::emulator::step::{self, RopeWriteCall};
use pensieve::attention::emulator::Schedule;
use pensieve::attention::{KvPool, KvShape};
use pensieve::engine::KvPrecision;
use pensieve::model::Activation;

const TYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// Agreement with the f64 value, relative to the output's largest magnitude: rounding once to
/// the type (f32 sums in a different order for f32).
fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-5,
        DType::F16 => 2e-3,
        _ => 1.6e-2,
    }
}

/// Seeded values in [-scale, scale), as `dtype`.
fn values(shape: &[usize], seed: u64, scale: f32, dtype: DType) -> Tensor {
    let n: usize = shape.iter().product();
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let v: Vec<f32> = (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

fn f64s(t: &Tensor) -> Vec<f64> {
    let v = t.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
    v.to_vec1::<f32>()
        .unwrap()
        .iter()
        .map(|&x| f64::from(x))
        .collect()
}

/// Whether `got` is within `tol` of `want`, relative to `want`'s largest magnitude.
fn close(what: &str, got: &Tensor, want: &[f64], tol: f64) -> Result<(), String> {
    let got = f64s(got);
    let scale = want.iter().fold(1e-30f64, |m, x| m.max(x.abs()));
    let worst = (got.iter().zip(want))
        .map(|(a, b)| {
            if a.is_nan() {
                f64::INFINITY
            } else {
                (a - b).abs()
            }
        })
        .fold(0.0, f64::max);
    match worst <= tol * scale && got.len() == want.len() {
        true => Ok(()),
        false => Err(format!(
            "{what}: {worst:e} from the reference (scale {scale:e})"
        )),
    }
}

/// The fused add and norm against `x + y` rounded to the type (bit for bit) and its norm in
/// f64, for rows shorter and longer than a block.
fn check_add_rms_norm(variant: usize) -> Result<(), String> {
    for dtype in TYPES {
        for dim in [96, 700] {
            let (x, y) = (
                values(&[5, dim], 1, 3.0, dtype),
                values(&[5, dim], 2, 3.0, dtype),
            );
            let w = values(&[dim], 3, 1.5, dtype);
            let sum_want = (x.to_dtype(DType::F32).unwrap() + y.to_dtype(DType::F32).unwrap())
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let (s, wv) = (f64s(&sum_want), f64s(&w));
            let mut norm_want = Vec::with_capacity(s.len());
            for row in s.chunks(dim) {
                let ms = row.iter().map(|v| v * v).sum::<f64>() / dim as f64;
                let scale = 1.0 / (ms + 1e-5).sqrt();
                norm_want.extend(row.iter().zip(&wv).map(|(v, w)| v * scale * w));
            }
            for schedule in Schedule::ALL {
                let (sum, normed) = step::add_rms_norm(&x, &y, &w, 1e-5, variant, schedule)
                    .map_err(|e| e.to_string())?;
                let what = format!("{dtype:?} dim {dim} {schedule:?}");
                close(&format!("sum, {what}"), &sum, &s, 0.0)?;
                close(
                    &format!("norm, {what}"),
                    &normed,
                    &norm_want,
                    tolerance(dtype),
                )?;
            }
        }
    }
    Ok(())
}

/// The fused activation against `act(g) * u` in f64.
fn check_gated(variant: usize) -> Result<(), String> {
    for dtype in TYPES {
        for act in [
            Activation::Silu,
            Activation::GeluTanh,
            Activation::ClampedSwiglu,
        ] {
            let (g, u) = (
                values(&[3, 300], 4, 9.0, dtype),
                values(&[3, 300], 5, 9.0, dtype),
            );
            let want: Vec<f64> = (f64s(&g).iter().zip(f64s(&u)))
                .map(|(&g, u)| match act {
                    Activation::Silu => g / (1.0 + (-g).exp()) * u,
                    Activation::GeluTanh => {
                        let c = (2.0 / std::f64::consts::PI).sqrt();
                        0.5 * g * (1.0 + (c * g * (1.0 + 0.044715 * g * g)).tanh()) * u
                    }
                    _ => {
                        let g = g.min(7.0);
                        g / (1.0 + (-1.702 * g).exp()) * (u.clamp(-7.0, 7.0) + 1.0)
                    }
                })
                .collect();
            for schedule in Schedule::ALL {
                let got = step::gated(&g, &u, act, variant, schedule).map_err(|e| e.to_string())?;
                close(
                    &format!("{dtype:?} {act:?} {schedule:?}"),
                    &got,
                    &want,
                    tolerance(dtype),
                )?;
            }
        }
    }
    Ok(())
}

/// RoPE and the KV write against the rotation in f64: the queries in f32, each token's key
/// and value at its slot of the pools, every other slot untouched.
fn check_rope_write(variant: usize) -> Result<(), String> {
    let (heads, kv_heads, tokens, n_slots) = (4, 2, 3, 8);
    let slots = [5u32, 1, 6];
    for (dtype, pool_dtype) in [
        (DType::F32, DType::F32),
        (DType::F32, DType::F16),
        (DType::F16, DType::F16),
        (DType::BF16, DType::BF16),
    ] {
        for (head_dim, interleaved) in [(64, false), (64, true), (256, false)] {
            let half = head_dim / 2;
            let q = values(&[tokens, heads * head_dim], 6, 2.0, dtype);
            let k = values(&[tokens, kv_heads * head_dim], 7, 2.0, dtype);
            let v = values(&[tokens, kv_heads * head_dim], 8, 2.0, dtype);
            let angles: Vec<f32> = (0..tokens * half)
                .map(|i| (i / half) as f32 * 0.37 + (i % half) as f32 * 0.11)
                .collect();
            let angles = Tensor::from_vec(angles, (tokens, half), &Device::Cpu).unwrap();
            let cos = angles.cos().unwrap().to_dtype(dtype).unwrap();
            let sin = angles.sin().unwrap().to_dtype(dtype).unwrap();
            let pool = |seed| values(&[n_slots, kv_heads, head_dim], seed, 1.0, pool_dtype);
            let (k_pool, v_pool) = (pool(9), pool(10));
            let (c, s) = (f64s(&cos), f64s(&sin));
            let turn = |x: &[f64], row: usize| -> Vec<f64> {
                let mut y = x.to_vec();
                for i in 0..half {
                    let (i1, i2) = if interleaved {
                        (2 * i, 2 * i + 1)
                    } else {
                        (i, i + half)
                    };
                    let (ci, si) = (c[row * half + i], s[row * half + i]);
                    y[i1] = x[i1] * ci - x[i2] * si;
                    y[i2] = x[i1] * si + x[i2] * ci;
                }
                y
            };
            let (qv, kv, vv) = (f64s(&q), f64s(&k), f64s(&v));
            let q_want: Vec<f64> = (0..tokens * heads)
                .flat_map(|rh| turn(&qv[rh * head_dim..(rh + 1) * head_dim], rh / heads))
                .collect();
            let (mut k_want, mut v_want) = (f64s(&k_pool), f64s(&v_pool));
            for (r, &slot) in slots.iter().enumerate() {
                for h in 0..kv_heads {
                    let (at, to) = (
                        (r * kv_heads + h) * head_dim,
                        (slot as usize * kv_heads + h) * head_dim,
                    );
                    let rotated = turn(&kv[at..at + head_dim], r);
                    k_want[to..to + head_dim].copy_from_slice(&rotated);
                    v_want[to..to + head_dim].copy_from_slice(&vv[at..at + head_dim]);
                }
            }
            let call = RopeWriteCall {
                q: &q,
                k: &k,
                v: &v,
                cos: &cos,
                sin: &sin,
                slots: &slots,
                k_pool: &k_pool,
                v_pool: &v_pool,
                n_heads: heads,
                interleaved,
            };
            for schedule in Schedule::ALL {
                let (q_out, k_out, v_out) =
                    step::rope_write(&call, variant, schedule).map_err(|e| e.to_string())?;
                let what =
                    format!("{dtype:?}/{pool_dtype:?} d{head_dim} {interleaved} {schedule:?}");
                close(&format!("q, {what}"), &q_out, &q_want, 1e-6)?;
                close(
                    &format!("k pool, {what}"),
                    &k_out,
                    &k_want,
                    tolerance(pool_dtype),
                )?;
                close(
                    &format!("v pool, {what}"),
                    &v_out,
                    &v_want,
                    tolerance(pool_dtype),
                )?;
            }
        }
    }
    Ok(())
}

/// The writes of codes against the CPU pool's own write (`KvPool::write`): the same bytes, for
/// every activation type, both layouts, heads turned (64, 128, 256) and not (96), into a pool
/// whose other slots stay as they were.
fn check_write_codes(variant: usize) -> Result<(), String> {
    let (kv_heads, tokens, n_slots) = (2, 3, 8);
    let slots = [5u32, 1, 6];
    for dtype in TYPES {
        for head_dim in [64, 96, 128, 256] {
            for kv in [KvPrecision::Q8, KvPrecision::Q4] {
                let shape = KvShape {
                    num_layers: 1,
                    num_kv_heads: kv_heads,
                    head_dim,
                };
                let pool = KvPool::new(shape, n_slots, kv, &Device::Cpu).unwrap();
                // Values up to 3, the scale of each block its own (a few heads' blocks small).
                let k = values(&[tokens, kv_heads * head_dim], 11, 3.0, dtype);
                let v = values(&[tokens, kv_heads * head_dim], 12, 0.05, dtype);
                let (k_pool, v_pool) = pool.layer(0).unwrap();
                let (k_pool, v_pool) = (k_pool.clone(), v_pool.clone());
                let heads = |t: &Tensor| t.reshape((tokens, kv_heads, head_dim)).unwrap();
                let index = pool.write_index(&slots, &Device::Cpu).unwrap();
                pool.write(0, &index, &heads(&k), &heads(&v)).unwrap();
                let (k_want, v_want) = pool.layer(0).unwrap();
                let bytes = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<u8>().unwrap();
                for schedule in Schedule::ALL {
                    let (k_got, v_got) =
                        step::write_codes((&k, &v), &slots, (&k_pool, &v_pool), variant, schedule)
                            .map_err(|e| e.to_string())?;
                    let what = format!("{dtype:?} d{head_dim} {kv:?} {schedule:?}");
                    if bytes(&k_got) != bytes(k_want) || bytes(&v_got) != bytes(v_want) {
                        return Err(format!("codes written otherwise than the CPU's: {what}"));
                    }
                }
            }
        }
    }
    Ok(())
}

#[test]
fn the_writes_of_codes_are_the_cpu_pool_s() {
    check_write_codes(0).unwrap();
}

#[test]
fn the_fused_add_and_norm_match_the_reference() {
    check_add_rms_norm(0).unwrap();
}

#[test]
fn the_fused_activation_matches_the_reference() {
    check_gated(0).unwrap();
}

#[test]
fn rope_and_the_kv_write_match_the_reference() {
    check_rope_write(0).unwrap();
}

#[test]
fn broken_step_kernels_are_caught() {
    let variants = step::variants();
    assert!(
        variants.len() > 1,
        "no mutants of the step kernels were built"
    );
    for (i, (name, why)) in variants.iter().enumerate().skip(1) {
        let caught = [
            check_add_rms_norm(i),
            check_gated(i),
            check_rope_write(i),
            check_write_codes(i),
        ]
        .into_iter()
        .find_map(Result::err);
        assert!(caught.is_some(), "mutant {name} ({why}) passed every check");
        eprintln!("{name}: caught ({})", caught.unwrap_or_default());
    }
}

//! Small GGUF files of seeded random weights, in the types candle cannot write (MXFP4): what
//! the llama.cpp reference checks load in both engines. The `random_gguf` example writes the
//! same files for `scripts/reference/llamacpp_gguf_logits.py`, which runs llama.cpp on them.

use std::io::Write;
use std::path::Path;

/// A metadata value.
pub enum Meta {
    U32(u32),
    F32(f32),
    Str(&'static str),
    Strs(Vec<String>),
}

/// A tensor's data.
pub enum Data {
    F32(Vec<f32>),
    /// MXFP4 blocks: an E8M0 exponent, then 16 bytes of E2M1 nibbles (values `j` and `j + 16`
    /// in byte `j`'s low and high nibble).
    Mxfp4(Vec<u8>),
}

/// A tensor: its name, dimensions innermost first (as GGUF lists them) and data.
pub struct Tensor {
    pub name: String,
    pub dims: Vec<usize>,
    pub data: Data,
}

const ALIGN: usize = 32;

fn string(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

/// Writes a GGUF (version 3) file of `meta` and `tensors`.
pub fn write(path: &Path, meta: &[(String, Meta)], tensors: &[Tensor]) -> std::io::Result<()> {
    let mut head = b"GGUF".to_vec();
    head.extend(3u32.to_le_bytes());
    head.extend((tensors.len() as u64).to_le_bytes());
    head.extend((meta.len() as u64).to_le_bytes());
    for (key, value) in meta {
        string(&mut head, key);
        match value {
            Meta::U32(v) => {
                head.extend(4u32.to_le_bytes());
                head.extend(v.to_le_bytes());
            }
            Meta::F32(v) => {
                head.extend(6u32.to_le_bytes());
                head.extend(v.to_le_bytes());
            }
            Meta::Str(s) => {
                head.extend(8u32.to_le_bytes());
                string(&mut head, s);
            }
            Meta::Strs(items) => {
                head.extend(9u32.to_le_bytes());
                head.extend(8u32.to_le_bytes());
                head.extend((items.len() as u64).to_le_bytes());
                for s in items {
                    string(&mut head, s);
                }
            }
        }
    }
    let mut data = Vec::new();
    for t in tensors {
        string(&mut head, &t.name);
        head.extend((t.dims.len() as u32).to_le_bytes());
        for &d in &t.dims {
            head.extend((d as u64).to_le_bytes());
        }
        let (kind, bytes): (u32, Vec<u8>) = match &t.data {
            Data::F32(v) => (0, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
            Data::Mxfp4(b) => (39, b.clone()),
        };
        head.extend(kind.to_le_bytes());
        head.extend((data.len() as u64).to_le_bytes());
        data.extend(bytes);
        data.resize(data.len().div_ceil(ALIGN) * ALIGN, 0);
    }
    head.resize(head.len().div_ceil(ALIGN) * ALIGN, 0);
    let mut f = std::fs::File::create(path)?;
    f.write_all(&head)?;
    f.write_all(&data)
}

/// Deterministic values in [-1, 1).
struct Noise(u64);

impl Noise {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    fn f32(&mut self, n: usize, scale: f32, offset: f32) -> Data {
        Data::F32((0..n).map(|_| offset + scale * self.next()).collect())
    }

    /// `n` values of MXFP4: random codes, exponents for weights of magnitude up to 3/8.
    fn mxfp4(&mut self, n: usize) -> Data {
        let mut bytes = Vec::with_capacity(n / 32 * 17);
        for _ in 0..n / 32 {
            bytes.push(121 + ((self.next() + 1.0) * 1.5) as u8);
            bytes.extend((0..16).map(|_| ((self.next() + 1.0) * 128.0) as u8));
        }
        Data::Mxfp4(bytes)
    }
}

/// The small gpt-oss of `scripts/reference/transformers_logits.py`'s `gpt_oss` case (2
/// layers, sliding and full, hidden 64, 4 experts of which 2 per token, YaRN), as a GGUF
/// file with its experts in MXFP4, from `seed`. Its vocabulary is 300 placeholder pieces with
/// no merges: the checks feed token ids.
pub fn tiny_gpt_oss(seed: u64) -> (Vec<(String, Meta)>, Vec<Tensor>) {
    let (vocab, hidden, ff, heads, kv_heads, head_dim, experts) = (300, 64, 128, 4, 2, 16, 4);
    let a = "gpt-oss";
    let meta = vec![
        ("general.architecture".to_string(), Meta::Str(a)),
        ("general.alignment".into(), Meta::U32(ALIGN as u32)),
        (format!("{a}.block_count"), Meta::U32(2)),
        (format!("{a}.context_length"), Meta::U32(256)),
        (format!("{a}.embedding_length"), Meta::U32(hidden as u32)),
        (format!("{a}.feed_forward_length"), Meta::U32(ff as u32)),
        (
            format!("{a}.expert_feed_forward_length"),
            Meta::U32(ff as u32),
        ),
        (format!("{a}.attention.head_count"), Meta::U32(heads as u32)),
        (
            format!("{a}.attention.head_count_kv"),
            Meta::U32(kv_heads as u32),
        ),
        (
            format!("{a}.attention.key_length"),
            Meta::U32(head_dim as u32),
        ),
        (
            format!("{a}.attention.value_length"),
            Meta::U32(head_dim as u32),
        ),
        (
            format!("{a}.attention.layer_norm_rms_epsilon"),
            Meta::F32(1e-6),
        ),
        (format!("{a}.attention.sliding_window"), Meta::U32(6)),
        (format!("{a}.rope.freq_base"), Meta::F32(10_000.0)),
        (format!("{a}.rope.scaling.type"), Meta::Str("yarn")),
        (format!("{a}.rope.scaling.factor"), Meta::F32(8.0)),
        (
            format!("{a}.rope.scaling.original_context_length"),
            Meta::U32(32),
        ),
        (format!("{a}.expert_count"), Meta::U32(experts as u32)),
        (format!("{a}.expert_used_count"), Meta::U32(2)),
        ("tokenizer.ggml.model".into(), Meta::Str("gpt2")),
        (
            "tokenizer.ggml.tokens".into(),
            Meta::Strs((0..vocab).map(|i| format!("t{i}")).collect()),
        ),
        ("tokenizer.ggml.merges".into(), Meta::Strs(Vec::new())),
    ];
    let mut noise = Noise(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let t = |name: String, dims: Vec<usize>, data: Data| Tensor { name, dims, data };
    let (q, kv) = (heads * head_dim, kv_heads * head_dim);
    let mut tensors = vec![
        t(
            "token_embd.weight".into(),
            vec![hidden, vocab],
            noise.f32(hidden * vocab, 1.0, 0.0),
        ),
        t(
            "output_norm.weight".into(),
            vec![hidden],
            noise.f32(hidden, 0.1, 1.0),
        ),
        t(
            "output.weight".into(),
            vec![hidden, vocab],
            noise.f32(hidden * vocab, 0.2, 0.0),
        ),
    ];
    for l in 0..2 {
        let b = |s: &str| format!("blk.{l}.{s}");
        let mut layer = vec![
            (
                b("attn_norm.weight"),
                vec![hidden],
                noise.f32(hidden, 0.1, 1.0),
            ),
            (
                b("attn_q.weight"),
                vec![hidden, q],
                noise.f32(hidden * q, 0.2, 0.0),
            ),
            (b("attn_q.bias"), vec![q], noise.f32(q, 0.1, 0.0)),
            (
                b("attn_k.weight"),
                vec![hidden, kv],
                noise.f32(hidden * kv, 0.2, 0.0),
            ),
            (b("attn_k.bias"), vec![kv], noise.f32(kv, 0.1, 0.0)),
            (
                b("attn_v.weight"),
                vec![hidden, kv],
                noise.f32(hidden * kv, 0.2, 0.0),
            ),
            (b("attn_v.bias"), vec![kv], noise.f32(kv, 0.1, 0.0)),
            (
                b("attn_output.weight"),
                vec![q, hidden],
                noise.f32(q * hidden, 0.2, 0.0),
            ),
            (
                b("attn_output.bias"),
                vec![hidden],
                noise.f32(hidden, 0.1, 0.0),
            ),
            (
                b("attn_sinks.weight"),
                vec![heads],
                noise.f32(heads, 1.0, 0.0),
            ),
            (
                b("post_attention_norm.weight"),
                vec![hidden],
                noise.f32(hidden, 0.1, 1.0),
            ),
            (
                b("ffn_gate_inp.weight"),
                vec![hidden, experts],
                noise.f32(hidden * experts, 0.5, 0.0),
            ),
            (
                b("ffn_gate_inp.bias"),
                vec![experts],
                noise.f32(experts, 0.1, 0.0),
            ),
        ];
        // Each projection's stacked experts, `k` inputs to `rows` outputs, and their biases.
        for (proj, rows, k) in [
            ("gate", ff, hidden),
            ("up", ff, hidden),
            ("down", hidden, ff),
        ] {
            let name = |kind: &str| b(&format!("ffn_{proj}_exps.{kind}"));
            let weight = noise.mxfp4(k * rows * experts);
            layer.push((name("weight"), vec![k, rows, experts], weight));
            let bias = noise.f32(rows * experts, 0.1, 0.0);
            layer.push((name("bias"), vec![rows, experts], bias));
        }
        tensors.extend(layer.into_iter().map(|(n, d, x)| t(n, d, x)));
    }
    (meta, tensors)
}

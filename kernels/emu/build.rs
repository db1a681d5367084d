// The emulator's build step, included by the crate's `build.rs` under the `cuda-emulator`
// feature (see `kernels/README.md`).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

/// One compiled copy of a kernel source: the original (`prefix` empty) or a mutant.
struct Variant {
    name: String,
    why: String,
    /// The kernel source's file name (`attention.cu`, `step.cu`): which table lists it.
    file: String,
    source: PathBuf,
    /// Prepended to every entry point's name, so that all variants link side by side.
    prefix: String,
}

/// Builds the static library and the Rust table of entry points.
pub fn build() -> Result<(), String> {
    let out = PathBuf::from(std::env::var("OUT_DIR").map_err(|e| format!("OUT_DIR: {e}"))?);
    let sanitize = std::env::var("PENSIEVE_EMU_SANITIZE").is_ok_and(|v| v == "1");
    let sources = super::kernel_sources()?;
    let mut variants = Vec::new();
    let mut names = BTreeSet::new();
    // Each source's own entry points: a variant of it declares only those.
    let mut by_file = BTreeMap::new();
    for src in &sources {
        let text = std::fs::read_to_string(src).map_err(|e| format!("{}: {e}", src.display()))?;
        names.extend(entry_points(&text));
        by_file.insert(file_name(src), entry_points(&text));
        variants.push(Variant {
            name: "kernel".into(),
            why: "the kernel as it ships".into(),
            file: file_name(src),
            source: src.clone(),
            prefix: String::new(),
        });
        variants.extend(mutants(src, &text, &out)?);
    }

    let mut objects = Vec::new();
    for v in &variants {
        let mut b = compiler(sanitize);
        b.file(&v.source)
            .flag("-x")
            .flag("c++")
            .flag("-include")
            .flag("kernels/emu/cuda_emu.h")
            .include("kernels/emu/include")
            // Shared memory is the object's .bss as one section (renamed below).
            .flag("-fno-data-sections");
        for n in &names {
            if !v.prefix.is_empty() {
                b.define(n, Some(format!("{}{n}", v.prefix).as_str()));
            }
        }
        let objs = b.try_compile_intermediates().map_err(|e| e.to_string())?;
        for obj in objs {
            // A kernel's `__shared__` arrays are its translation unit's only mutable statics:
            // one named section, so that the runtime finds them (`__start_pensieve_emu_shared`)
            // and poisons them before every block.
            let status = Command::new(objcopy())
                .arg("--rename-section")
                .arg(".bss=pensieve_emu_shared")
                .arg(&obj)
                .status()
                .map_err(|e| format!("objcopy did not start: {e}"))?;
            if !status.success() {
                return Err(format!("objcopy failed on {}", obj.display()));
            }
            objects.push(obj);
        }
    }
    let mut runtime = compiler(sanitize);
    runtime.file("kernels/emu/runtime.cc").include("kernels/emu");
    for o in &objects {
        runtime.object(o);
    }
    runtime
        .try_compile("pensieve_emu")
        .map_err(|e| e.to_string())?;
    if sanitize {
        // The sanitizers' runtimes travel with the library to whatever links it (a link
        // argument would reach only this package's own binaries). Loaded after the C
        // library, ASan must be told not to insist on coming first (`.ci/run` sets
        // `verify_asan_link_order=0`).
        println!("cargo::rustc-link-lib=dylib=asan");
        println!("cargo::rustc-link-lib=dylib=ubsan");
    }
    std::fs::write(out.join("emu_kernels.rs"), rust_table(&variants, &by_file))
        .map_err(|e| format!("emu_kernels.rs: {e}"))
}

fn compiler(sanitize: bool) -> cc::Build {
    let mut b = cc::Build::new();
    b.cpp(true)
        .std("gnu++17")
        .warnings(true)
        .extra_warnings(true)
        .warnings_into_errors(true)
        .flag("-Wno-unknown-pragmas")
        // The kernels read f16 and f32 arrays through 16-byte vector types, as CUDA code does.
        .flag("-fno-strict-aliasing");
    if sanitize {
        b.opt_level(1)
            .flag("-fsanitize=address,undefined")
            .flag("-fno-sanitize-recover=all")
            .flag("-fno-omit-frame-pointer");
    }
    b
}

fn objcopy() -> String {
    std::env::var("OBJCOPY").unwrap_or_else(|_| "objcopy".into())
}

fn file_name(src: &Path) -> String {
    src.file_name()
        .and_then(|f| f.to_str())
        .unwrap_or_default()
        .to_string()
}

/// The kernels' entry points: every `pensieve_...` identifier of the source.
fn entry_points(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("pensieve_") {
        let tail = &rest[at..];
        let len = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        let preceded = rest[..at]
            .chars()
            .next_back()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
        if !preceded {
            names.insert(tail[..len].to_string());
        }
        rest = &tail[len..];
    }
    names
}

/// The mutants of `src` listed in `kernels/emu/mutants`, written to `out`.
fn mutants(src: &Path, text: &str, out: &Path) -> Result<Vec<Variant>, String> {
    let list = std::fs::read_to_string("kernels/emu/mutants")
        .map_err(|e| format!("kernels/emu/mutants: {e}"))?;
    let file = src.file_name().and_then(|f| f.to_str()).unwrap_or_default();
    let mut found = Vec::new();
    let mut current: Option<(String, String, String, Option<String>)> = None;
    let unescape = |s: &str| s.replace("\\n", "\n");
    for line in list.lines().chain(std::iter::once("mutant end-of-list")) {
        if let Some(rest) = line.strip_prefix("mutant ") {
            if let Some((name, why, find, Some(replace))) = current.take() {
                found.push((name, why, find, replace));
            }
            let (head, why) = rest.split_once(':').unwrap_or((rest, ""));
            let (source, name) = head.trim().split_once('/').unwrap_or(("", head.trim()));
            if source == file {
                current = Some((name.into(), why.trim().into(), String::new(), None));
            }
        } else if let Some((_, _, find, replace)) = current.as_mut() {
            if let Some(t) = line.strip_prefix("- ") {
                *find = unescape(t);
            } else if let Some(t) = line.strip_prefix("+ ") {
                *replace = Some(unescape(t));
            } else if line == "+" {
                *replace = Some(String::new());
            }
        }
    }
    let mut variants = Vec::new();
    for (name, why, find, replace) in found {
        if text.matches(&find).count() != 1 {
            return Err(format!(
                "kernels/emu/mutants: the text of mutant {name} must occur exactly once in {file}"
            ));
        }
        let path = out.join(format!("mutant_{name}.cu"));
        std::fs::write(&path, text.replacen(&find, &replace, 1))
            .map_err(|e| format!("{}: {e}", path.display()))?;
        variants.push(Variant {
            prefix: format!("mutant_{name}_"),
            name,
            why,
            file: file.to_string(),
            source: path,
        });
    }
    Ok(variants)
}

/// An entry point's parameters, by its name.
fn signature(name: &str) -> &'static str {
    if name.ends_with("merge") {
        "(plan: *const u32, part_acc: *const f32, part_ml: *const f32, out: *mut f32, \
         p: Params, d: i32)"
    } else if name.starts_with("pensieve_step_add_rms_norm") {
        "(x: *const c_void, y: *const c_void, w: *const c_void, out: *mut c_void, rows: i32, \
         dim: i32, eps: f32)"
    } else if name.starts_with("pensieve_step_gated") {
        "(g: *const c_void, u: *const c_void, out: *mut c_void, total: i64, n: i32, \
         g_stride: i32, u_stride: i32, act: i32)"
    } else if name.starts_with("pensieve_step_write_codes") {
        "(k: *const c_void, v: *const c_void, k_stride: i32, v_stride: i32, slots: *const u32, \
         slot_stride: i32, k_pool: *mut u8, v_pool: *mut u8, n_kv_heads: i32, head_dim: i32, \
         turned: i32)"
    } else if name.starts_with("pensieve_step_rope_write") {
        "(q: *const c_void, k: *const c_void, v: *const c_void, q_stride: i32, k_stride: i32, \
         v_stride: i32, cos: *const c_void, sin: *const c_void, slots: *const u32, \
         q_out: *mut f32, k_pool: *mut c_void, v_pool: *mut c_void, n_heads: i32, \
         n_kv_heads: i32, head_dim: i32, interleaved: i32)"
    } else {
        "(q: *const f32, k: *const c_void, v: *const c_void, plan: *const u32, \
         out: *mut f32, part_acc: *mut f32, part_ml: *mut f32, p: Params)"
    }
}

/// `unsafe extern "C"` declarations and the tables `VARIANTS` (attention) and `STEP_VARIANTS`
/// (the step's fused kernels) for `src/attention/cuda/emulator.rs`.
fn rust_table(variants: &[Variant], by_file: &BTreeMap<String, BTreeSet<String>>) -> String {
    let mut s = String::from("// Generated by kernels/emu/build.rs.\nunsafe extern \"C\" {\n");
    for v in variants {
        for n in by_file.get(&v.file).into_iter().flatten() {
            let _ = writeln!(s, "    fn {}{n}{};", v.prefix, signature(n));
        }
    }
    s.push_str("}\n\n/// The step's fused kernels and their mutants, as the emulator runs them.\n");
    s.push_str("pub(super) static STEP_VARIANTS: &[StepVariant] = &[\n");
    const TYPES: [&str; 3] = ["f32", "f16", "bf16"];
    for v in variants.iter().filter(|v| v.file == "step.cu") {
        let p = &v.prefix;
        let _ = writeln!(s, "    StepVariant {{ name: {:?}, why: {:?},", v.name, v.why);
        let each = |f: &dyn Fn(&str) -> String| TYPES.map(f).join(", ");
        let norm = each(&|t| format!("{p}pensieve_step_add_rms_norm_{t}"));
        let gated = each(&|t| format!("{p}pensieve_step_gated_{t}"));
        let rope = each(&|t| {
            let pools = each(&|pool| format!("{p}pensieve_step_rope_write_{t}_{pool}"));
            format!("[{pools}]")
        });
        let codes = ["q8", "q4"].map(|c| {
            let types = each(&|t| format!("{p}pensieve_step_write_codes_{t}_{c}"));
            format!("[{types}]")
        });
        let _ = writeln!(s, "        write_codes: [{}],", codes.join(", "));
        let _ = writeln!(s, "        add_rms_norm: [{norm}],");
        let _ = writeln!(s, "        gated: [{gated}],");
        let _ = writeln!(s, "        rope_write: [{rope}] }},");
    }
    s.push_str("];\n\n/// The kernel and its mutants, as compiled for the emulator.\n");
    s.push_str("pub(super) static VARIANTS: &[Variant] = &[\n");
    for v in variants.iter().filter(|v| v.file == "attention.cu") {
        let p = &v.prefix;
        let _ = writeln!(
            s,
            "    Variant {{ name: {:?}, why: {:?}, merge: {p}pensieve_attention_merge, attend: [",
            v.name, v.why
        );
        for dtype in ["f32", "f16", "bf16", "q8", "q4"] {
            let _ = write!(s, "        [");
            for d in [64, 128, 256] {
                let _ = write!(s, "{p}pensieve_attention_{dtype}_d{d}, ");
            }
            s.push_str("],\n");
        }
        s.push_str("    ], mma: [\n");
        for dtype in ["f16", "bf16"] {
            let _ = write!(s, "        [");
            for d in [64, 128, 256] {
                let _ = write!(s, "{p}pensieve_attention_mma_{dtype}_d{d}, ");
            }
            s.push_str("],\n");
        }
        s.push_str("    ] },\n");
    }
    s.push_str("];\n");
    s
}

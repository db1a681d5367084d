//! Builds the kernels of `kernels/` for the features that use them:
//! - `cuda`: compiles `kernels/*.cu` with `nvcc` into one fatbin per source in `OUT_DIR`
//!   (machine code for sm_80 and sm_90, PTX for newer GPUs), which the crate embeds;
//! - `cuda-emulator` (the tests turn it on): compiles the same sources unchanged for the CPU
//!   against the emulator's shim (`kernels/emu`), with the deliberately broken copies listed in
//!   `kernels/emu/mutants`, into a static library, and writes the Rust table of their entry
//!   points (`OUT_DIR/emu_kernels.rs`). `PENSIEVE_EMU_SANITIZE=1` builds it with
//!   AddressSanitizer and UBSan.
//!
//! Without either feature it does nothing, so the default build needs no CUDA and no C++.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

#[cfg(feature = "cuda-emulator")]
mod emulator {
    include!("kernels/emu/build.rs");
}

fn main() -> ExitCode {
    println!("cargo::rerun-if-changed=kernels");
    println!("cargo::rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo::rerun-if-env-changed=CUDA_ROOT");
    println!("cargo::rerun-if-env-changed=PENSIEVE_EMU_SANITIZE");
    let result = (|| {
        if std::env::var_os("CARGO_FEATURE_CUDA").is_some() {
            compile_kernels()?;
        }
        #[cfg(feature = "cuda-emulator")]
        emulator::build()?;
        Ok::<(), String>(())
    })();
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The `.cu` files of `kernels/`, sorted.
fn kernel_sources() -> Result<Vec<PathBuf>, String> {
    let mut sources = Vec::new();
    for entry in std::fs::read_dir("kernels").map_err(|e| format!("kernels/: {e}"))? {
        let src = entry.map_err(|e| format!("kernels/: {e}"))?.path();
        if src.extension().is_some_and(|x| x == "cu") {
            sources.push(src);
        }
    }
    sources.sort();
    Ok(sources)
}

/// Machine code for the GPUs we target (no JIT at start) and PTX for newer ones.
/// `CUDA_COMPUTE_CAP` adds one more machine-code target.
fn compile_kernels() -> Result<(), String> {
    let out = PathBuf::from(std::env::var("OUT_DIR").map_err(|e| format!("OUT_DIR: {e}"))?);
    let mut caps = vec!["80".to_string(), "90".to_string()];
    if let Ok(cap) = std::env::var("CUDA_COMPUTE_CAP") {
        let cap: String = cap.chars().filter(char::is_ascii_digit).collect();
        if !cap.is_empty() && !caps.contains(&cap) {
            caps.push(cap);
        }
    }
    let newest = caps.iter().max().cloned().unwrap_or_default();
    let mut gencode: Vec<String> = caps
        .iter()
        .map(|c| format!("-gencode=arch=compute_{c},code=sm_{c}"))
        .collect();
    gencode.push(format!(
        "-gencode=arch=compute_{newest},code=compute_{newest}"
    ));
    let nvcc = match std::env::var_os("CUDA_ROOT") {
        Some(root) => Path::new(&root).join("bin").join("nvcc"),
        None => PathBuf::from("nvcc"),
    };
    for src in kernel_sources()? {
        let fatbin = out.join(src.with_extension("fatbin").file_name().unwrap_or_default());
        let status = Command::new(&nvcc)
            .args(["-fatbin", "-O3"])
            .args(&gencode)
            .arg(&src)
            .arg("-o")
            .arg(&fatbin)
            .status()
            .map_err(|e| {
                format!(
                    "the `cuda` feature compiles {} with nvcc, which did not start ({}: {e}); \
                     install CUDA 13.0, or run `eval \"$(scripts/cuda-toolkit)\"` first",
                    src.display(),
                    nvcc.display()
                )
            })?;
        if !status.success() {
            return Err(format!("nvcc failed on {} ({status})", src.display()));
        }
    }
    Ok(())
}

//! With the `cuda` feature, compiles `kernels/*.cu` to PTX with `nvcc` (arch from
//! `CUDA_COMPUTE_CAP`, default 80: sm_80 PTX also JITs on newer GPUs) into `OUT_DIR`, where the
//! crate embeds it. Without the feature it does nothing, so the default build needs no CUDA.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

fn main() -> ExitCode {
    println!("cargo::rerun-if-changed=kernels");
    println!("cargo::rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo::rerun-if-env-changed=CUDA_ROOT");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return ExitCode::SUCCESS;
    }
    match compile_kernels() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn compile_kernels() -> Result<(), String> {
    let out = PathBuf::from(std::env::var("OUT_DIR").map_err(|e| format!("OUT_DIR: {e}"))?);
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "80".into());
    let cap: String = cap.chars().filter(char::is_ascii_digit).collect();
    let nvcc = match std::env::var_os("CUDA_ROOT") {
        Some(root) => Path::new(&root).join("bin").join("nvcc"),
        None => PathBuf::from("nvcc"),
    };
    let sources = std::fs::read_dir("kernels").map_err(|e| format!("kernels/: {e}"))?;
    for entry in sources {
        let src = entry.map_err(|e| format!("kernels/: {e}"))?.path();
        if src.extension().is_none_or(|x| x != "cu") {
            continue;
        }
        let ptx = out.join(src.with_extension("ptx").file_name().unwrap_or_default());
        let status = Command::new(&nvcc)
            .args(["-ptx", "-O3", &format!("-arch=sm_{cap}")])
            .arg(&src)
            .arg("-o")
            .arg(&ptx)
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

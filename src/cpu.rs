//! The CPU's vector paths, detected at run time: which instructions the kernels of every layer
//! (the model's matmuls, the attention op) take on this machine. Below both, so neither reaches
//! into the other for it.

mod quantize;

pub(crate) use quantize::{quantize_block, QK};

/// Which instructions run the kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Isa {
    Scalar,
    /// AVX2, FMA and F16C: the baseline of every x86-64 machine we run on.
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// AVX-512 F/BW with VNNI (`vpdpbusd`) for the integer kernel; AVX2 for the rest.
    #[cfg(target_arch = "x86_64")]
    Avx512,
    /// [`Isa::Avx512`], with AMX-INT8's tile multiply for the integer kernel's tiles of 16 rows
    /// (prefill).
    #[cfg(target_arch = "x86_64")]
    Amx,
    /// NEON with the dot-product extension (`sdot`) for the integer kernel, NEON's fused
    /// multiply-add for the float one.
    #[cfg(target_arch = "aarch64")]
    Neon,
}

impl Isa {
    /// The best path this CPU has, or the one `PENSIEVE_ISA` names (`Scalar`, `Avx2`,
    /// `Avx512`, `Amx`, `Neon`; any case) where the CPU has it: to compare paths on one
    /// machine, or to step back from one.
    pub(crate) fn detect() -> Self {
        static DETECTED: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
        *DETECTED.get_or_init(|| {
            let mut all = Self::available();
            if let Ok(name) = std::env::var("PENSIEVE_ISA") {
                match all
                    .iter()
                    .find(|i| format!("{i:?}").eq_ignore_ascii_case(&name))
                {
                    Some(&isa) => return isa,
                    None => tracing::warn!(
                        PENSIEVE_ISA = %name,
                        available = ?all,
                        "this CPU has no such path: using the best it has"
                    ),
                }
            }
            all.pop().unwrap_or(Isa::Scalar)
        })
    }

    /// Every path this CPU can run, best last.
    #[cfg_attr(
        not(any(target_arch = "x86_64", target_arch = "aarch64")),
        allow(unused_mut)
    )]
    pub(crate) fn available() -> Vec<Self> {
        let mut all = vec![Isa::Scalar];
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx2") && has!("fma") && has!("f16c") {
                all.push(Isa::Avx2);
                if has!("avx512f") && has!("avx512bw") && has!("avx512vnni") {
                    all.push(Isa::Avx512);
                    if amx_usable() {
                        all.push(Isa::Amx);
                    }
                }
            }
        }
        #[cfg(target_arch = "aarch64")]
        if std::arch::is_aarch64_feature_detected!("dotprod") {
            all.push(Isa::Neon);
        }
        all
    }

    /// The path's name for people: benchmark tables print it beside the CPU's.
    #[cfg(feature = "internals")]
    pub(crate) fn label(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => "AVX2",
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => "AVX-512 VNNI",
            #[cfg(target_arch = "x86_64")]
            Isa::Amx => "AMX-INT8 tiles with AVX-512 VNNI",
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => "NEON dot product",
        }
    }
}

#[cfg(target_arch = "x86_64")]
/// Whether this process can run tiles: the CPU has AMX-TILE and AMX-INT8 (and the AVX-512 the
/// factors use), and Linux grants the tiles' register state, which it hands out only on
/// request (asked once, for the whole process).
fn amx_usable() -> bool {
    use std::arch::x86_64::__cpuid_count;
    static USABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *USABLE.get_or_init(|| {
        use std::arch::is_x86_feature_detected as has;
        if !(has!("avx512f") && has!("avx512bw") && has!("avx512vnni")) {
            return false;
        }
        // Leaf 7 exists on every CPU with AVX-512. EDX bit 24: AMX-TILE; bit 25: AMX-INT8.
        let edx = __cpuid_count(7, 0).edx;
        edx >> 24 & 1 == 1 && edx >> 25 & 1 == 1 && request_tile_state()
    })
}

/// Asks Linux for the tile data state (`ARCH_REQ_XCOMP_PERM` for `XFEATURE_XTILEDATA`).
#[cfg(target_arch = "x86_64")]
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn request_tile_state() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: this `arch_prctl` call takes two integers and touches no memory of ours.
    unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        ) == 0
    }
}

#[cfg(target_arch = "x86_64")]
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn request_tile_state() -> bool {
    false
}

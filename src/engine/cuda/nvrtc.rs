//! Compiling kiln's CUDA C with NVRTC for the GPU at hand, with an on-disk cache.
//!
//! Kernels are compiled at run time so one binary serves every GPU generation, each getting
//! code for its own architecture (`sm_XX`, a CUBIN: nothing is left for the driver to JIT).
//! Compiling takes a fraction of a second per program, so the CUBIN is stored under
//! `$XDG_CACHE_HOME/kiln/nvrtc` (or `~/.cache/kiln/nvrtc`), named by a hash of everything that
//! determines it: source, options, architecture and NVRTC version. A second start compiles
//! nothing. A cache that cannot be read or written only costs the compile time.

use super::CudaError;
use cudarc::nvrtc::{result as nvrtc, sys};
use std::ffi::CString;
use std::path::{Path, PathBuf};

/// Options every kiln kernel is compiled with. Precise division and square root are NVRTC's
/// defaults and stay on: the kernels are checked against the CPU reference to fp32 accuracy.
const OPTIONS: &[&str] = &["--std=c++17"];

/// Programs with instructions of Hopper's arch-specific target (warpgroup MMA, `wgmma`): on
/// sm_90 they are compiled for `sm_90a`, whose CUBIN runs on compute capability 9.0 alone,
/// which is the GPU at hand; on every other GPU for its plain `sm_XX` (their sources compile
/// those kernels' bodies only for sm_90a).
const HOPPER_SPECIFIC: &[&str] = &["attention_tc"];

/// NVRTC's target for program `name` on `sm_{arch}`.
fn arch_option(name: &str, arch: u32) -> String {
    if arch == 90 && HOPPER_SPECIFIC.contains(&name) {
        "--gpu-architecture=sm_90a".to_string()
    } else {
        format!("--gpu-architecture=sm_{arch}")
    }
}

/// A compiled program and whether it came from the cache.
pub struct Compiled {
    pub cubin: Vec<u8>,
    pub from_cache: bool,
}

/// The directory the cache lives in, if the environment names a home for it.
pub fn cache_dir() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("KILN_CACHE_DIR") {
        return Some(PathBuf::from(p).join("nvrtc"));
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .filter(|p| p.is_absolute())
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("kiln").join("nvrtc"))
}

/// 64-bit FNV-1a; stable across Rust releases, unlike `DefaultHasher`, so cache names persist.
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for &b in part.iter().chain(&[0xff]) {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

/// NVRTC's version, part of the cache key: a newer compiler may emit different code.
fn nvrtc_version() -> Result<(i32, i32), CudaError> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: both pointers are valid for writes.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| CudaError::Driver(format!("nvrtcVersion: {e:?}")))?;
    Ok((major, minor))
}

/// Compiles `source` (named `name` in messages) for `sm_{arch}`, or reads it from the cache
/// directory `cache` (usually [`cache_dir`]; `None` compiles every time).
pub fn compile(
    name: &str,
    source: &str,
    arch: u32,
    cache: Option<&Path>,
) -> Result<Compiled, CudaError> {
    let arch_opt = arch_option(name, arch);
    let cached = cache_path(name, source, arch, cache)?;
    if let Some(bytes) = cached.as_deref().and_then(|p| std::fs::read(p).ok()) {
        return Ok(Compiled {
            cubin: bytes,
            from_cache: true,
        });
    }
    let mut options: Vec<String> = OPTIONS.iter().map(|s| s.to_string()).collect();
    options.push(arch_opt);
    let cubin = compile_uncached(name, source, &options)?;
    if let Some(path) = &cached {
        store(path, &cubin);
    }
    Ok(Compiled {
        cubin,
        from_cache: false,
    })
}

/// The file under `cache` that holds the CUBIN of `source` for `sm_{arch}` (none without a
/// cache directory). Its name carries the key: source, options, target and NVRTC version.
fn cache_path(
    name: &str,
    source: &str,
    arch: u32,
    cache: Option<&Path>,
) -> Result<Option<PathBuf>, CudaError> {
    let (major, minor) = nvrtc_version()?;
    let key = fnv1a(&[
        source.as_bytes(),
        OPTIONS.join(" ").as_bytes(),
        arch_option(name, arch).as_bytes(),
        format!("nvrtc {major}.{minor}").as_bytes(),
    ]);
    Ok(cache.map(|d| d.join(format!("{name}-sm{arch}-{key:016x}.cubin"))))
}

/// Whether [`compile`] would read `source` from the cache instead of compiling it.
pub fn is_cached(name: &str, source: &str, arch: u32, cache: Option<&Path>) -> bool {
    matches!(cache_path(name, source, arch, cache), Ok(Some(p)) if p.is_file())
}

/// Forgets a cached CUBIN the driver refused, so the next start recompiles it.
pub fn evict(cache: Option<&Path>, name: &str, arch: u32) {
    let Some(dir) = cache else { return };
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let prefix = format!("{name}-sm{arch}-");
    for e in entries.flatten() {
        if e.file_name()
            .to_str()
            .is_some_and(|n| n.starts_with(&prefix))
        {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// Writes under a temporary name and renames, so a concurrent reader never sees half a file.
fn store(path: &Path, bytes: &[u8]) {
    let Some(dir) = path.parent() else { return };
    if std::fs::create_dir_all(dir).is_err() {
        return;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    if std::fs::write(&tmp, bytes).is_ok() && std::fs::rename(&tmp, path).is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
}

/// Owns an `nvrtcProgram` so every exit path destroys it.
struct Program(sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the program was created by `create_program` and is destroyed only here.
        let _ = unsafe { nvrtc::destroy_program(self.0) };
    }
}

fn compile_uncached(name: &str, source: &str, options: &[String]) -> Result<Vec<u8>, CudaError> {
    let nvrtc_err = |what: &str, e: nvrtc::NvrtcError| {
        CudaError::Driver(format!("NVRTC {what} for {name}.cu: {e:?}"))
    };
    let src = CString::new(source).map_err(|_| CudaError::Compile {
        program: name.to_string(),
        log: "source contains a NUL byte".to_string(),
    })?;
    let file_name = CString::new(format!("{name}.cu")).map_err(|_| CudaError::Compile {
        program: name.to_string(),
        log: "program name contains a NUL byte".to_string(),
    })?;
    let prog =
        Program(nvrtc::create_program(&src, Some(&file_name)).map_err(|e| nvrtc_err("create", e))?);
    // SAFETY: `prog.0` is a live program (destroyed only by `Program::drop`).
    let compiled = unsafe { nvrtc::compile_program(prog.0, options) };
    if let Err(e) = compiled {
        // SAFETY: as above.
        let log = unsafe { nvrtc::get_program_log(prog.0) }
            .map(|raw| {
                let bytes: Vec<u8> = raw
                    .iter()
                    .take_while(|&&c| c != 0)
                    .map(|&c| c as u8)
                    .collect();
                String::from_utf8_lossy(&bytes).into_owned()
            })
            .unwrap_or_default();
        return Err(CudaError::Compile {
            program: name.to_string(),
            log: format!("{e:?} with options {options:?}\n{log}"),
        });
    }
    let mut size = 0usize;
    // SAFETY: `prog.0` compiled successfully; `size` is valid for writes.
    unsafe { sys::nvrtcGetCUBINSize(prog.0, &mut size) }
        .result()
        .map_err(|e| nvrtc_err("CUBIN size", e))?;
    let mut cubin = vec![0u8; size];
    // SAFETY: `cubin` has exactly the size NVRTC reported.
    unsafe { sys::nvrtcGetCUBIN(prog.0, cubin.as_mut_ptr().cast()) }
        .result()
        .map_err(|e| nvrtc_err("CUBIN", e))?;
    Ok(cubin)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_hopper_specific_programs_get_sm90a_and_only_on_sm90() {
        assert_eq!(arch_option("attention_tc", 90), "--gpu-architecture=sm_90a");
        assert_eq!(arch_option("attention_tc", 80), "--gpu-architecture=sm_80");
        assert_eq!(arch_option("layernorm", 90), "--gpu-architecture=sm_90");
        assert_eq!(
            arch_option("attention_tc", 100),
            "--gpu-architecture=sm_100"
        );
    }

    #[test]
    fn cache_key_hash_is_stable_and_separates_parts() {
        assert_eq!(fnv1a(&[b"a"]), fnv1a(&[b"a"]));
        assert_ne!(fnv1a(&[b"ab", b"c"]), fnv1a(&[b"a", b"bc"]));
        // Pinned value: a change here silently invalidates every user's cache.
        assert_eq!(fnv1a(&[]), 0xcbf2_9ce4_8422_2325);
    }
}

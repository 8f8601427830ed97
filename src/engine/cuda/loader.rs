//! Finding the CUDA libraries at run time.
//!
//! kiln is built with no CUDA toolkit and loads `libcuda`, `libnvrtc` and `libcublasLt` when a
//! GPU is first used. cudarc's loader asks `dlopen` for a list of names and panics when none
//! resolves, and `dlopen` only searches `LD_LIBRARY_PATH` and the system directories, while a
//! toolkit usually lives in `/usr/local/cuda/lib64`. So before cudarc touches a library, this
//! module looks for it itself: first under the names cudarc will use, then as files in the
//! usual toolkit directories. A library opened by path stays loaded, and a later `dlopen` of
//! its soname (one of cudarc's names) returns that same library. When nothing is found the
//! error names the library, the file names tried and the directories searched.

use super::CudaError;
use libloading::Library;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

/// The CUDA libraries kiln uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CudaLibrary {
    /// `libcuda`, installed with the NVIDIA driver.
    Driver,
    /// `libnvrtc`, the run-time CUDA C compiler from the toolkit.
    Nvrtc,
    /// `libcublasLt`, the matrix-multiply library from the toolkit.
    CublasLt,
    /// `libcusparse`, used only as a benchmark baseline (`kiln bench bk`).
    Cusparse,
    /// `libnccl`, the collectives of data-parallel training (`kiln train --gpus N`).
    Nccl,
}

impl CudaLibrary {
    /// The stem cudarc builds its candidate names from.
    fn stem(self) -> &'static str {
        match self {
            CudaLibrary::Driver => "cuda",
            CudaLibrary::Nvrtc => "nvrtc",
            CudaLibrary::CublasLt => "cublasLt",
            CudaLibrary::Cusparse => "cusparse",
            CudaLibrary::Nccl => "nccl",
        }
    }

    /// What to install when the library is missing.
    fn remedy(self) -> &'static str {
        match self {
            CudaLibrary::Driver => "install the NVIDIA driver",
            CudaLibrary::Nvrtc | CudaLibrary::CublasLt | CudaLibrary::Cusparse => {
                "install the CUDA toolkit or add its lib64 directory to LD_LIBRARY_PATH"
            }
            CudaLibrary::Nccl => {
                "install NCCL (libnccl2, or the nvidia-nccl pip wheel) or add its directory to LD_LIBRARY_PATH"
            }
        }
    }
}

/// The `lib` directories of NVIDIA's pip wheels (`nvidia-cuda-nvrtc`, `nvidia-cublas`, ...)
/// under the Python installations kiln can find: an active virtualenv or conda environment,
/// the user's site-packages, and the system ones.
fn pip_wheel_dirs() -> Vec<PathBuf> {
    let mut lib_roots: Vec<PathBuf> = Vec::new();
    for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Some(root) = std::env::var_os(var) {
            lib_roots.push(PathBuf::from(root).join("lib"));
        }
    }
    if let Some(home) = std::env::var_os("HOME") {
        lib_roots.push(PathBuf::from(home).join(".local/lib"));
    }
    lib_roots.extend(["/usr/local/lib", "/usr/lib"].map(PathBuf::from));
    let mut dirs = Vec::new();
    for root in lib_roots {
        let Ok(entries) = std::fs::read_dir(&root) else {
            continue;
        };
        for e in entries.flatten() {
            if !e.file_name().to_string_lossy().starts_with("python3") {
                continue;
            }
            for site in ["site-packages", "dist-packages"] {
                let nvidia = e.path().join(site).join("nvidia");
                for pkg in ["cu13", "cu12", "cuda_nvrtc", "cublas"] {
                    let lib = nvidia.join(pkg).join("lib");
                    if lib.is_dir() {
                        dirs.push(lib);
                    }
                }
            }
        }
    }
    dirs
}

/// Directories searched after the dynamic loader's own path: the toolkit named by the usual
/// environment variables, the standard install locations, then NVIDIA's pip wheels.
fn search_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    for var in ["CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"] {
        if let Some(root) = std::env::var_os(var) {
            let root = PathBuf::from(root);
            dirs.push(root.join("lib64"));
            dirs.push(root.join("lib"));
        }
    }
    for d in [
        "/usr/local/cuda/lib64",
        "/usr/local/cuda/targets/x86_64-linux/lib",
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib64",
        "/usr/lib",
        "/usr/lib/wsl/lib",
    ] {
        dirs.push(PathBuf::from(d));
    }
    dirs.extend(pip_wheel_dirs());
    dirs
}

/// Libraries opened by path, kept open for the life of the process so cudarc's `dlopen` by
/// soname finds them.
fn keep_open() -> &'static Mutex<Vec<Library>> {
    static OPEN: OnceLock<Mutex<Vec<Library>>> = OnceLock::new();
    OPEN.get_or_init(|| Mutex::new(Vec::new()))
}

fn hold(lib: Library) {
    if let Ok(mut open) = keep_open().lock() {
        open.push(lib);
    }
}

/// Opens `lib` so that cudarc's loader will find it; idempotent and cheap after the first call.
pub fn ensure_loaded(lib: CudaLibrary) -> Result<(), CudaError> {
    static DRIVER: OnceLock<Result<(), CudaError>> = OnceLock::new();
    static NVRTC: OnceLock<Result<(), CudaError>> = OnceLock::new();
    static CUBLASLT: OnceLock<Result<(), CudaError>> = OnceLock::new();
    static CUSPARSE: OnceLock<Result<(), CudaError>> = OnceLock::new();
    static NCCL: OnceLock<Result<(), CudaError>> = OnceLock::new();
    let cell = match lib {
        CudaLibrary::Driver => &DRIVER,
        CudaLibrary::Nvrtc => &NVRTC,
        CudaLibrary::CublasLt => &CUBLASLT,
        CudaLibrary::Cusparse => &CUSPARSE,
        CudaLibrary::Nccl => &NCCL,
    };
    cell.get_or_init(|| find_and_open(lib)).clone()
}

fn find_and_open(lib: CudaLibrary) -> Result<(), CudaError> {
    open_by_stem(lib.stem(), lib.remedy(), lib == CudaLibrary::Nvrtc)
}

/// Opens `lib<stem>.so` under cudarc's candidate names, first through the loader's path, then
/// as files in [`search_dirs`]; `with_nvrtc_builtins` also opens NVRTC's companion library.
fn open_by_stem(
    stem: &str,
    remedy: &'static str,
    with_nvrtc_builtins: bool,
) -> Result<(), CudaError> {
    let mut names = cudarc::get_lib_name_candidates(stem);
    // cudarc's list repeats some names; trying one twice only lengthens the error message.
    let mut seen = std::collections::HashSet::new();
    names.retain(|n| seen.insert(n.clone()));
    // SAFETY (all `Library::new` calls below): loading a CUDA library runs only its own
    // initialisers, which have no preconditions on this process.
    for name in &names {
        if let Ok(l) = unsafe { Library::new(name) } {
            hold(l);
            return Ok(());
        }
    }
    let dirs = search_dirs();
    for dir in &dirs {
        for name in &names {
            let path = dir.join(name);
            if !path.is_file() {
                continue;
            }
            if let Ok(l) = unsafe { Library::new(&path) } {
                hold(l);
                if with_nvrtc_builtins {
                    // NVRTC opens its builtins library by name at the first compile; it sits
                    // next to libnvrtc and is as invisible to dlopen as libnvrtc was.
                    open_nvrtc_builtins(dir);
                }
                return Ok(());
            }
        }
    }
    Err(CudaError::LibraryMissing {
        library: format!("lib{stem}.so"),
        tried: names.join(", "),
        searched: format!(
            "the dynamic loader's path (LD_LIBRARY_PATH, ld.so.cache, /lib, /usr/lib), then {}",
            dirs.iter()
                .map(|d| d.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
        remedy,
    })
}

fn open_nvrtc_builtins(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let is_builtins = entry
            .file_name()
            .to_str()
            .is_some_and(|n| n.starts_with("libnvrtc-builtins.so"));
        if is_builtins && let Ok(l) = unsafe { Library::new(entry.path()) } {
            hold(l);
            return;
        }
    }
}

/// Runs `f`, turning a panic inside cudarc (a missing symbol in an old driver, a library that
/// vanished) into an error instead of a crash. The default panic message is silenced for the
/// duration, since the error carries it.
pub fn guarded<T>(what: &str, f: impl FnOnce() -> Result<T, CudaError>) -> Result<T, CudaError> {
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    std::panic::set_hook(hook);
    result.unwrap_or_else(|payload| {
        let msg = payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "unknown panic".to_string());
        Err(CudaError::Driver(format!("{what}: {msg}")))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_names_itself_and_where_it_looked() {
        // No machine has this library; the error must say what and where, not panic.
        let err = open_by_stem("kiln_no_such_cuda_library", "nothing to do", false).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("libkiln_no_such_cuda_library.so"), "{msg}");
        assert!(msg.contains("/usr/local/cuda/lib64"), "{msg}");
    }

    #[test]
    fn guarded_turns_a_panic_into_an_error() {
        let r: Result<(), CudaError> = guarded("probe", || panic!("Missing symbol cuFoo"));
        let msg = r.unwrap_err().to_string();
        assert!(msg.contains("Missing symbol cuFoo"), "{msg}");
    }
}

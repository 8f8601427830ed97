//! Optional per-operation timing, switched on with `KILN_PROFILE=1`.
//!
//! Each op in `ops` opens a scope; when profiling is on, closing it waits for the device and
//! adds the wall time to a table keyed by op name. Waiting serialises the host with the GPU,
//! so a profiled step is slower than a real one: the table says where time goes, not how
//! fast a step is.

use super::Tensor;
use super::cuda::CudaBackend;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("KILN_PROFILE").is_ok_and(|v| v != "0"))
}

/// Calls and seconds per op name.
static TABLE: Mutex<BTreeMap<&'static str, (u64, f64)>> = Mutex::new(BTreeMap::new());

pub struct Scope {
    name: &'static str,
    gpu: Option<Arc<CudaBackend>>,
    start: Instant,
}

/// Starts timing `name` for an op whose tensors live where `t` does (None when off).
pub fn scope(name: &'static str, t: &Tensor) -> Option<Scope> {
    if !enabled() {
        return None;
    }
    let gpu = t.pool().cuda().ok().cloned();
    if let Some(g) = &gpu {
        let _ = g.synchronize();
    }
    Some(Scope {
        name,
        gpu,
        start: Instant::now(),
    })
}

impl Drop for Scope {
    fn drop(&mut self) {
        if let Some(g) = &self.gpu {
            let _ = g.synchronize();
        }
        let secs = self.start.elapsed().as_secs_f64();
        if let Ok(mut t) = TABLE.lock() {
            let e = t.entry(self.name).or_insert((0, 0.0));
            e.0 += 1;
            e.1 += secs;
        }
    }
}

/// The table so far, slowest first, as markdown; empty when profiling is off.
pub fn report() -> String {
    let Ok(t) = TABLE.lock() else {
        return String::new();
    };
    if t.is_empty() {
        return String::new();
    }
    let total: f64 = t.values().map(|v| v.1).sum();
    let mut rows: Vec<_> = t.iter().collect();
    rows.sort_by(|a, b| b.1.1.total_cmp(&a.1.1));
    let mut s = String::from("| op | calls | total ms | share |\n|---|---|---|---|\n");
    for (name, (calls, secs)) in rows {
        s += &format!(
            "| {name} | {calls} | {:.1} | {:.1}% |\n",
            secs * 1e3,
            100.0 * secs / total
        );
    }
    s
}

pub fn reset() {
    if let Ok(mut t) = TABLE.lock() {
        t.clear();
    }
}

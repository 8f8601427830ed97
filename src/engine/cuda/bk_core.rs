//! BK-Core (resolvent diagonal of tridiagonal systems) forward and backward on the GPU;
//! reference: [`crate::engine::cpu::bk_core`]. The kernels and their chunked scan are
//! described in `bk_core.cu`: for large calls with unit off-diagonals, the long-chunk kernels
//! (one launch per direction, 16 to 64 positions per thread); otherwise one fused launch per
//! direction while a sequence fits in a block's shared memory (N <= 8192 backward, more
//! forward on sm_90), and the multi-launch chunk path beyond. None waits for the stream; the
//! non-finite flag is read separately.

use super::{CudaBackend, Kernel, Program, Result, as_i32, check_len};
use crate::engine::cpu::bk_core::BkShape;
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg, sys::CUfunction_attribute};

pub(super) const PROGRAM: Program = Program {
    name: "bk_core",
    source: include_str!("bk_core.cu"),
    kernels: &[
        Kernel::BkChunkMaps,
        Kernel::BkScanMaps,
        Kernel::BkForward,
        Kernel::BkBackwardLocal,
        Kernel::BkScanAffine,
        Kernel::BkBackwardFinal,
        Kernel::BkForwardFused,
        Kernel::BkBackwardFused,
        Kernel::BkForwardLong16,
        Kernel::BkForwardLong32,
        Kernel::BkForwardLong64,
        Kernel::BkBackwardLong16,
        Kernel::BkBackwardLong32,
        Kernel::BkForwardWarp4,
        Kernel::BkForwardWarp8,
        Kernel::BkForwardWarp16,
        Kernel::BkBackwardWarp4,
        Kernel::BkBackwardWarp8,
        Kernel::BkBackwardWarp16,
    ],
    elem_kernels: &[],
    dtypes: &[],
};

/// Positions per thread; must match `BK_CHUNK` in `bk_core.cu`.
const CHUNK: usize = 32;
const CHUNK_BLOCK: u32 = 256;
/// Warps per block of the per-sequence scans.
const SCAN_WARPS: u32 = 4;

/// Largest chunk the fused kernels aim for: short serial sweeps, a team of at most
/// `FUSED_MAX_WARPS` warps per sequence. The fused backward keeps a chunk in registers and
/// takes at most this many positions per thread; must match `BKF_CHUNK` in `bk_core.cu`.
const FUSED_CHUNK: usize = 16;
const FUSED_MAX_WARPS: usize = 16;
/// Up to this many positions in a call, the fused kernels aim for `SMALL_CHUNK` positions per
/// thread instead: a small call cannot fill the GPU, its time is one thread's chain of serial
/// steps, and a shorter chain (with a deeper scan) finishes sooner.
const SMALL_CALL: usize = 1 << 17;
const SMALL_CHUNK: usize = 4;
/// Threads per block of the fused forward when its teams are smaller (several sequences).
const FUSED_MIN_BLOCK: usize = 256;

/// Launch geometry of the fused forward for one shape (see `bk_forward_fused` in the `.cu`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Fused {
    /// Warps per sequence.
    team_warps: usize,
    /// Positions per thread.
    chunk: usize,
    block: usize,
    /// Sequences per block.
    teams: usize,
    shared_bytes: usize,
}

impl Fused {
    /// The backward also keeps each thread's first q pivot in shared memory.
    fn backward_shared_bytes(&self) -> usize {
        self.shared_bytes + 8 * self.block
    }

    /// `(tw, chunk)` as the kernels' integer arguments.
    fn args(&self, op: &'static str) -> Result<(i32, i32)> {
        Ok((
            as_i32(op, "team warps", self.team_warps)?,
            as_i32(op, "chunk", self.chunk)?,
        ))
    }

    fn launch(&self, batch: usize, shared_bytes: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (batch.div_ceil(self.teams) as u32, 1, 1),
            block_dim: (self.block as u32, 1, 1),
            shared_mem_bytes: shared_bytes as u32,
        }
    }

    fn plan(n: usize, batch: usize, has_off: bool) -> Fused {
        let aim = if batch * n <= SMALL_CALL {
            SMALL_CHUNK
        } else {
            FUSED_CHUNK
        };
        let team_warps = n
            .div_ceil(32 * aim)
            .next_power_of_two()
            .min(FUSED_MAX_WARPS);
        let team = 32 * team_warps;
        let block = team.max(FUSED_MIN_BLOCK);
        let teams = block / team;
        // `pad(n - 1) + 1` slots per staged array: one spare per 32 against bank conflicts.
        let slots = n + (n - 1) / 32;
        let shared_bytes =
            teams * slots * 12 + if has_off { slots * 4 } else { 0 } + (block / 32) * 64;
        Fused {
            team_warps,
            chunk: n.div_ceil(team),
            block,
            teams,
            shared_bytes,
        }
    }
}

/// The warp kernels (`bk_forward_warp{4,8,16}`, `bk_backward_warp{4,8,16}` in `bk_core.cu`):
/// one warp per sequence, its positions in registers, for small calls with unit
/// off-diagonals and N = 32 L. Returns the kernel.
fn warp_kernel(n: usize, batch: usize, has_off: bool, backward: bool) -> Option<Kernel> {
    if has_off || batch * n > SMALL_CALL {
        return None;
    }
    Some(match (n, backward) {
        (128, false) => Kernel::BkForwardWarp4,
        (256, false) => Kernel::BkForwardWarp8,
        (512, false) => Kernel::BkForwardWarp16,
        (128, true) => Kernel::BkBackwardWarp4,
        (256, true) => Kernel::BkBackwardWarp8,
        (512, true) => Kernel::BkBackwardWarp16,
        _ => return None,
    })
}

fn warp_launch(batch: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (batch.div_ceil(WARP_SEQS_PER_BLOCK) as u32, 1, 1),
        block_dim: (32 * WARP_SEQS_PER_BLOCK as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}
/// Sequences (warps) per block of the warp kernels: one, so that a call of a few sequences
/// spreads over as many SMs (eight warps in one block took 5.5 us at 8 x 512 on an H200,
/// one warp 3.1 us).
const WARP_SEQS_PER_BLOCK: usize = 1;

/// Positions per thread the long-chunk kernels come in (`bk_forward_long{64,32,16}`,
/// `bk_backward_long{32,16}` in `bk_core.cu`), longest first, and their largest blocks
/// (`BKL_MAX_BLOCK`, `BKL_MAX_BLOCK_BACK`).
const LONG_CHUNKS_FORWARD: [usize; 3] = [64, 32, 16];
const LONG_CHUNKS_BACKWARD: [usize; 2] = [32, 16];
const LONG_MAX_BLOCK_FORWARD: usize = 256;
const LONG_MAX_BLOCK_BACKWARD: usize = 512;
/// Threads per block of the long-chunk kernels when a sequence needs fewer.
const LONG_MIN_BLOCK: usize = 128;
/// A long-chunk call aims for at least this many threads (16 warps on each of 128 SMs): the
/// longest chunk that still gives them has the least scan work per position, and a shorter
/// one keeps a GPU busy when the call is smaller.
const LONG_AIM_THREADS: usize = 1 << 16;

/// Launch geometry of a long-chunk kernel (see "Long-chunk kernels" in the `.cu`): unit
/// off-diagonals, whole warps per sequence, `chunk` positions per thread, and a call big
/// enough to fill the GPU (a small call's time is one thread's serial chain, which the fused
/// kernels' shorter chunks finish sooner).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Long {
    backward: bool,
    chunk: usize,
    block: usize,
    /// Sequences per block.
    seqs: usize,
    shared_bytes: usize,
}

impl Long {
    fn plan(n: usize, batch: usize, has_off: bool, backward: bool) -> Option<Long> {
        if has_off || batch * n <= SMALL_CALL {
            return None;
        }
        let (chunks, max_block) = if backward {
            (&LONG_CHUNKS_BACKWARD[..], LONG_MAX_BLOCK_BACKWARD)
        } else {
            (&LONG_CHUNKS_FORWARD[..], LONG_MAX_BLOCK_FORWARD)
        };
        let fits = |l: usize| n.is_multiple_of(32 * l) && (n / l).max(LONG_MIN_BLOCK) <= max_block;
        let mut fitting = chunks.iter().copied().filter(|&l| fits(l));
        let chunk = fitting
            .clone()
            .find(|&l| batch * n / l >= LONG_AIM_THREADS)
            .or_else(|| fitting.next_back())?;
        let threads = n / chunk;
        let block = threads.max(LONG_MIN_BLOCK);
        // Shared words per thread: forward x and a store area (chunk + 20); backward x
        // (chunk + 4) and dL/dG (2 chunk + 4).
        let words = if backward { 3 * chunk + 8 } else { chunk + 20 };
        Some(Long {
            backward,
            chunk,
            block,
            seqs: block / threads,
            shared_bytes: block * words * 4 + (block / 32) * 64,
        })
    }

    fn kernel(&self) -> Kernel {
        match (self.backward, self.chunk) {
            (false, 64) => Kernel::BkForwardLong64,
            (false, 32) => Kernel::BkForwardLong32,
            (false, _) => Kernel::BkForwardLong16,
            (true, 32) => Kernel::BkBackwardLong32,
            (true, _) => Kernel::BkBackwardLong16,
        }
    }

    fn launch(&self, batch: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (batch.div_ceil(self.seqs) as u32, 1, 1),
            block_dim: (self.block as u32, 1, 1),
            shared_mem_bytes: self.shared_bytes as u32,
        }
    }
}

/// Optional super- and sub-diagonal (ones when absent).
pub type Offdiag<'a> = Option<(&'a CudaSlice<f32>, &'a CudaSlice<f32>)>;

/// Scratch for one shape, reusable across calls of that shape (the benchmark keeps one).
pub struct BkWork {
    shape: BkShape,
    maps: CudaSlice<f32>,
    enter: CudaSlice<f32>,
    nonfinite: CudaSlice<u32>,
    /// Backward only, allocated on first use.
    back: Option<BackWork>,
}

struct BackWork {
    /// Multi-launch path only, allocated on its first use.
    sweeps: Option<SweepWork>,
    zpart: CudaSlice<f32>,
    bpart: CudaSlice<f32>,
    cpart: CudaSlice<f32>,
}

/// The multi-launch backward's pivots and chunk adjoint maps.
struct SweepWork {
    rs: CudaSlice<f32>,
    qs: CudaSlice<f32>,
    aff: CudaSlice<f32>,
    carry: CudaSlice<f32>,
}

fn chunks(s: BkShape) -> usize {
    s.batch * s.n.div_ceil(CHUNK)
}

fn chunk_grid(s: BkShape) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (chunks(s).div_ceil(CHUNK_BLOCK as usize) as u32, 1, 1),
        block_dim: (CHUNK_BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn scan_grid(s: BkShape) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (s.batch.div_ceil(SCAN_WARPS as usize) as u32, 1, 1),
        block_dim: (32 * SCAN_WARPS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The kernels' integer arguments: `(has_off, batch, n, causal)`.
fn dims(op: &'static str, s: BkShape, off: &Offdiag) -> Result<(i32, i32, i32, i32)> {
    if s.batch == 0 || s.n == 0 {
        return Err(super::CudaError::Shape {
            op,
            detail: format!("batch {} x n {}: both must be at least 1", s.batch, s.n),
        });
    }
    as_i32(op, "batch x n", s.batch * s.n)?;
    Ok((
        i32::from(off.is_some()),
        as_i32(op, "batch", s.batch)?,
        as_i32(op, "n", s.n)?,
        i32::from(s.causal),
    ))
}

/// The forward's inputs against the shape; returns the kernels' integer arguments.
fn check_inputs(
    s: BkShape,
    v: &CudaSlice<f32>,
    z: &CudaSlice<f32>,
    off: Offdiag,
) -> Result<(i32, i32, i32, i32)> {
    const OP: &str = "bk_core";
    let d = dims(OP, s, &off)?;
    check_len(OP, "v", v, s.batch * s.n)?;
    check_len(OP, "z", z, 2)?;
    if let Some((b, c)) = off {
        check_len(OP, "super-diagonal", b, s.n - 1)?;
        check_len(OP, "sub-diagonal", c, s.n - 1)?;
    }
    Ok(d)
}

impl CudaBackend {
    /// Scratch for calls of shape `s`.
    pub fn bk_work(&self, s: BkShape) -> Result<BkWork> {
        // Above 48 KiB a kernel must opt in to its dynamic shared memory. Always the device's
        // limit, so that no shape lowers what another's launches need, and here rather than
        // per call, which keeps a host round of the driver out of the timed launches.
        for name in [
            Kernel::BkForwardFused,
            Kernel::BkBackwardFused,
            Kernel::BkForwardLong16,
            Kernel::BkForwardLong32,
            Kernel::BkForwardLong64,
            Kernel::BkBackwardLong16,
            Kernel::BkBackwardLong32,
        ] {
            self.function(name)?.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                self.info.shared_memory_per_block_optin as i32,
            )?;
        }
        let c = chunks(s);
        Ok(BkWork {
            shape: s,
            maps: self.alloc(16 * c)?,
            enter: self.alloc(8 * c)?,
            nonfinite: self.upload(&[0u32])?,
            back: None,
        })
    }

    /// Whether any forward since the last call wrote a non-finite `G` (reads one word back,
    /// so it waits for the stream), and clears the flag.
    pub fn bk_nonfinite(&self, w: &mut BkWork) -> Result<bool> {
        let bad = self.download(&w.nonfinite)?[0] != 0;
        if bad {
            self.stream.memset_zeros(&mut w.nonfinite)?;
        }
        Ok(bad)
    }

    /// The chunk matrices and their scan (shared by forward and backward).
    fn bk_enter(
        &self,
        w: &mut BkWork,
        v: &CudaSlice<f32>,
        z: &CudaSlice<f32>,
        off: Offdiag,
    ) -> Result<()> {
        let s = w.shape;
        let (has_off, batch, n, causal) = check_inputs(s, v, z, off)?;
        // Without off-diagonals the kernels never read b or c; any buffer stands in.
        let (b, c) = off.unwrap_or((v, v));
        let f = self.function(Kernel::BkChunkMaps)?;
        let mut l = self.stream.launch_builder(f);
        l.arg(&mut w.maps).arg(v).arg(z).arg(b).arg(c);
        l.arg(&has_off).arg(&batch).arg(&n).arg(&causal);
        // SAFETY: `maps` holds 16 floats per chunk; v holds batch * n; b, c hold n - 1.
        unsafe { l.launch(chunk_grid(s)) }?;
        let f = self.function(Kernel::BkScanMaps)?;
        let mut l = self.stream.launch_builder(f);
        l.arg(&mut w.enter)
            .arg(&w.maps)
            .arg(&batch)
            .arg(&n)
            .arg(&causal);
        // SAFETY: `enter` holds 8 floats per chunk; one warp per sequence.
        unsafe { l.launch(scan_grid(s)) }?;
        Ok(())
    }

    /// `out` (`2 * batch * n` floats) = `(Re, Im) G_ii`; a non-finite value sets the flag
    /// that [`Self::bk_nonfinite`] reads. Does not wait for the stream.
    pub fn bk_core_forward_with(
        &self,
        w: &mut BkWork,
        out: &mut CudaSlice<f32>,
        v: &CudaSlice<f32>,
        z: &CudaSlice<f32>,
        off: Offdiag,
    ) -> Result<()> {
        const OP: &str = "bk_core";
        let s = w.shape;
        check_len(OP, "out", out, 2 * s.batch * s.n)?;
        if let Some(kernel) = warp_kernel(s.n, s.batch, off.is_some(), false) {
            return self.bk_forward_unit(w, kernel, warp_launch(s.batch), out, v, z);
        }
        if let Some(plan) = Long::plan(s.n, s.batch, off.is_some(), false)
            && plan.shared_bytes <= self.info.shared_memory_per_block_optin
        {
            return self.bk_forward_unit(w, plan.kernel(), plan.launch(s.batch), out, v, z);
        }
        let plan = Fused::plan(s.n, s.batch, off.is_some());
        if plan.shared_bytes <= self.info.shared_memory_per_block_optin {
            return self.bk_forward_fused(w, plan, out, v, z, off);
        }
        self.bk_enter(w, v, z, off)?;
        let (has_off, batch, n, causal) = dims(OP, s, &off)?;
        let (b, c) = off.unwrap_or((v, v));
        let f = self.function(Kernel::BkForward)?;
        let mut l = self.stream.launch_builder(f);
        l.arg(out)
            .arg(&mut w.nonfinite)
            .arg(v)
            .arg(&w.enter)
            .arg(z)
            .arg(b)
            .arg(c);
        l.arg(&has_off).arg(&batch).arg(&n).arg(&causal);
        // SAFETY: lengths checked above and in `bk_enter`.
        unsafe { l.launch(chunk_grid(s)) }?;
        Ok(())
    }

    /// The one-launch forward for sequences whose working set fits in shared memory.
    fn bk_forward_fused(
        &self,
        w: &mut BkWork,
        plan: Fused,
        out: &mut CudaSlice<f32>,
        v: &CudaSlice<f32>,
        z: &CudaSlice<f32>,
        off: Offdiag,
    ) -> Result<()> {
        let s = w.shape;
        let (has_off, batch, n, causal) = check_inputs(s, v, z, off)?;
        let (b, c) = off.unwrap_or((v, v));
        let (team_warps, chunk) = plan.args("bk_core")?;
        let f = self.function(Kernel::BkForwardFused)?;
        let mut l = self.stream.launch_builder(f);
        l.arg(out).arg(&mut w.nonfinite).arg(v).arg(z).arg(b).arg(c);
        l.arg(&has_off)
            .arg(&batch)
            .arg(&n)
            .arg(&causal)
            .arg(&team_warps)
            .arg(&chunk);
        // SAFETY: lengths checked above; the block holds whole teams and gets the shared
        // memory the kernel's layout needs (`Fused::plan`, within the device's opt-in limit).
        unsafe { l.launch(plan.launch(s.batch, plan.shared_bytes)) }?;
        Ok(())
    }

    /// A unit-off-diagonal forward (the warp or the long-chunk kernels), launched as `cfg`.
    fn bk_forward_unit(
        &self,
        w: &mut BkWork,
        kernel: Kernel,
        cfg: LaunchConfig,
        out: &mut CudaSlice<f32>,
        v: &CudaSlice<f32>,
        z: &CudaSlice<f32>,
    ) -> Result<()> {
        let s = w.shape;
        let (_, batch, n, causal) = check_inputs(s, v, z, None)?;
        let f = self.function(kernel)?;
        let mut l = self.stream.launch_builder(f);
        l.arg(out).arg(&mut w.nonfinite).arg(v).arg(z);
        l.arg(&batch).arg(&n).arg(&causal);
        // SAFETY: lengths checked above and by the caller; `cfg` comes from the kernel's plan
        // (`warp_launch` for `warp_kernel`'s, `Long::launch`), which gives whole warps per
        // sequence, whole sequences per block and the shared memory of the kernel's layout.
        unsafe { l.launch(cfg) }?;
        Ok(())
    }

    /// Forward with fresh scratch; returns whether every `G` is finite.
    pub fn bk_core_forward(
        &self,
        out: &mut CudaSlice<f32>,
        v: &CudaSlice<f32>,
        z: &CudaSlice<f32>,
        off: Offdiag,
        s: BkShape,
    ) -> Result<bool> {
        let mut w = self.bk_work(s)?;
        self.bk_core_forward_with(&mut w, out, v, z, off)?;
        Ok(!self.bk_nonfinite(&mut w)?)
    }

    /// Overwrites `dv` with dL/dv for `d_out` (`2 * batch * n` floats: dL/dRe G, dL/dIm G)
    /// and adds dL/d(Re z, Im z) into `dz` and dL/db, dL/dc into `doff` where given (sums over
    /// the batch in a fixed order). Does not wait for the stream.
    #[allow(clippy::too_many_arguments)]
    pub fn bk_core_backward_with(
        &self,
        w: &mut BkWork,
        dv: &mut CudaSlice<f32>,
        d_out: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
        z: &CudaSlice<f32>,
        off: Offdiag,
        dz: Option<&mut CudaSlice<f32>>,
        doff: Option<(&mut CudaSlice<f32>, &mut CudaSlice<f32>)>,
    ) -> Result<()> {
        const OP: &str = "bk_core_backward";
        let s = w.shape;
        let elems = s.batch * s.n;
        check_len(OP, "dv", dv, elems)?;
        check_len(OP, "d_out", d_out, 2 * elems)?;
        if let Some(dz) = &dz {
            check_len(OP, "dz", dz, 2)?;
        }
        if let Some((db, dc)) = &doff {
            if off.is_none() {
                return Err(super::CudaError::Shape {
                    op: OP,
                    detail: "off-diagonal gradients asked for without off-diagonals".into(),
                });
            }
            check_len(OP, "db", db, s.n - 1)?;
            check_len(OP, "dc", dc, s.n - 1)?;
        }
        if w.back.is_none() {
            let prow = s.batch * (s.n - 1);
            w.back = Some(BackWork {
                sweeps: None,
                zpart: self.alloc(2 * chunks(s))?,
                bpart: self.alloc(prow.max(1))?,
                cpart: self.alloc(prow.max(1))?,
            });
        }
        let long = Long::plan(s.n, s.batch, off.is_some(), true)
            .filter(|p| p.shared_bytes <= self.info.shared_memory_per_block_optin);
        let plan = Fused::plan(s.n, s.batch, off.is_some());
        // zpart: one (dz) row per sequence on the one-launch paths, per chunk otherwise.
        let zrows = if let Some(kernel) = warp_kernel(s.n, s.batch, off.is_some(), true) {
            self.bk_backward_unit(w, kernel, warp_launch(s.batch), dv, d_out, v, z)?;
            s.batch
        } else if let Some(long) = long {
            let (kernel, cfg) = (long.kernel(), long.launch(s.batch));
            self.bk_backward_unit(w, kernel, cfg, dv, d_out, v, z)?;
            s.batch
        } else if plan.chunk <= FUSED_CHUNK
            && plan.backward_shared_bytes() <= self.info.shared_memory_per_block_optin
        {
            self.bk_backward_fused(w, plan, dv, d_out, v, z, off, doff.is_some())?;
            s.batch
        } else {
            self.bk_backward_sweeps(w, dv, d_out, v, z, off, doff.is_some())?;
            chunks(s)
        };
        let bw = w.back.as_ref().expect("allocated above");
        if let Some(dz) = dz {
            self.column_sum_accumulate::<f32>(dz, &bw.zpart, zrows, 2)?;
        }
        if let Some((db, dc)) = doff
            && s.n > 1
        {
            self.column_sum_accumulate::<f32>(db, &bw.bpart, s.batch, s.n - 1)?;
            self.column_sum_accumulate::<f32>(dc, &bw.cpart, s.batch, s.n - 1)?;
        }
        Ok(())
    }

    /// The one-launch backward: writes dv and the per-sequence partials `zpart`, and
    /// `bpart`/`cpart` when `learn_off`.
    #[allow(clippy::too_many_arguments)]
    fn bk_backward_fused(
        &self,
        w: &mut BkWork,
        plan: Fused,
        dv: &mut CudaSlice<f32>,
        d_out: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
        z: &CudaSlice<f32>,
        off: Offdiag,
        learn_off: bool,
    ) -> Result<()> {
        const OP: &str = "bk_core_backward";
        let s = w.shape;
        let (has_off, batch, n, causal) = check_inputs(s, v, z, off)?;
        let (b, c) = off.unwrap_or((v, v));
        let (team_warps, chunk) = plan.args(OP)?;
        let learn_off = i32::from(learn_off);
        let bw = w.back.as_mut().expect("allocated by the caller");
        let shared = plan.backward_shared_bytes();
        let f = self.function(Kernel::BkBackwardFused)?;
        let mut l = self.stream.launch_builder(f);
        l.arg(dv)
            .arg(&mut bw.zpart)
            .arg(&mut bw.bpart)
            .arg(&mut bw.cpart)
            .arg(&learn_off)
            .arg(v)
            .arg(d_out)
            .arg(z)
            .arg(b)
            .arg(c);
        l.arg(&has_off)
            .arg(&batch)
            .arg(&n)
            .arg(&causal)
            .arg(&team_warps)
            .arg(&chunk);
        // SAFETY: dv, d_out checked by the caller, the rest in `check_inputs`; zpart holds 2
        // floats per chunk (at least per sequence), bpart, cpart batch * (n - 1); the block
        // holds whole teams, chunk <= BKF_CHUNK and the shared memory matches the layout.
        unsafe { l.launch(plan.launch(s.batch, shared)) }?;
        Ok(())
    }

    /// A unit-off-diagonal backward (the warp or the long-chunk kernels), launched as `cfg`:
    /// dv and one dz row per sequence.
    #[allow(clippy::too_many_arguments)]
    fn bk_backward_unit(
        &self,
        w: &mut BkWork,
        kernel: Kernel,
        cfg: LaunchConfig,
        dv: &mut CudaSlice<f32>,
        d_out: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
        z: &CudaSlice<f32>,
    ) -> Result<()> {
        let s = w.shape;
        let (_, batch, n, causal) = check_inputs(s, v, z, None)?;
        let bw = w.back.as_mut().expect("allocated by the caller");
        let f = self.function(kernel)?;
        let mut l = self.stream.launch_builder(f);
        l.arg(dv).arg(&mut bw.zpart).arg(v).arg(d_out).arg(z);
        l.arg(&batch).arg(&n).arg(&causal);
        // SAFETY: dv, d_out checked by the caller, v and z above; zpart holds 2 floats per
        // chunk, at least per sequence; `cfg` comes from the kernel's plan (`warp_launch` for
        // `warp_kernel`'s, `Long::launch`), which gives whole warps per sequence, whole
        // sequences per block and the shared memory of the kernel's layout.
        unsafe { l.launch(cfg) }?;
        Ok(())
    }

    /// The multi-launch backward (sequences too long for the fused kernel): chunk maps and
    /// their scans, pivots through global scratch, then the adjoint sweeps.
    #[allow(clippy::too_many_arguments)]
    fn bk_backward_sweeps(
        &self,
        w: &mut BkWork,
        dv: &mut CudaSlice<f32>,
        d_out: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
        z: &CudaSlice<f32>,
        off: Offdiag,
        learn_off: bool,
    ) -> Result<()> {
        const OP: &str = "bk_core_backward";
        let s = w.shape;
        let elems = s.batch * s.n;
        self.bk_enter(w, v, z, off)?;
        let bw = w.back.as_mut().expect("allocated by the caller");
        if bw.sweeps.is_none() {
            let c = chunks(s);
            bw.sweeps = Some(SweepWork {
                rs: self.alloc(2 * elems)?,
                qs: self.alloc(2 * elems)?,
                aff: self.alloc(8 * c)?,
                carry: self.alloc(4 * c)?,
            });
        }
        let sw = bw.sweeps.as_mut().expect("allocated above");
        let (has_off, batch, n, causal) = dims(OP, s, &off)?;
        let (b, c) = off.unwrap_or((v, v));
        let f = self.function(Kernel::BkBackwardLocal)?;
        let mut l = self.stream.launch_builder(f);
        l.arg(&mut sw.rs)
            .arg(&mut sw.qs)
            .arg(&mut sw.aff)
            .arg(v)
            .arg(d_out)
            .arg(&w.enter);
        l.arg(z)
            .arg(b)
            .arg(c)
            .arg(&has_off)
            .arg(&batch)
            .arg(&n)
            .arg(&causal);
        // SAFETY: rs, qs hold 2 floats per position, aff 8 per chunk; inputs checked above.
        unsafe { l.launch(chunk_grid(s)) }?;
        let f = self.function(Kernel::BkScanAffine)?;
        let mut l = self.stream.launch_builder(f);
        l.arg(&mut sw.carry)
            .arg(&sw.aff)
            .arg(&batch)
            .arg(&n)
            .arg(&causal);
        // SAFETY: carry holds 4 floats per chunk; one warp per sequence.
        unsafe { l.launch(scan_grid(s)) }?;
        let learn_off = i32::from(learn_off);
        let f = self.function(Kernel::BkBackwardFinal)?;
        let mut l = self.stream.launch_builder(f);
        l.arg(dv)
            .arg(&mut bw.zpart)
            .arg(&mut bw.bpart)
            .arg(&mut bw.cpart)
            .arg(&learn_off);
        l.arg(&sw.rs)
            .arg(&sw.qs)
            .arg(v)
            .arg(d_out)
            .arg(&sw.carry)
            .arg(z)
            .arg(b)
            .arg(c);
        l.arg(&has_off).arg(&batch).arg(&n).arg(&causal);
        // SAFETY: zpart holds 2 floats per chunk; bpart, cpart batch * (n - 1) when learned.
        unsafe { l.launch(chunk_grid(s)) }?;
        Ok(())
    }

    /// Backward with fresh scratch.
    #[allow(clippy::too_many_arguments)]
    pub fn bk_core_backward(
        &self,
        dv: &mut CudaSlice<f32>,
        d_out: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
        z: &CudaSlice<f32>,
        off: Offdiag,
        s: BkShape,
        dz: Option<&mut CudaSlice<f32>>,
        doff: Option<(&mut CudaSlice<f32>, &mut CudaSlice<f32>)>,
    ) -> Result<()> {
        let mut w = self.bk_work(s)?;
        self.bk_core_backward_with(&mut w, dv, d_out, v, z, off, dz, doff)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A100's opt-in shared memory per block, the smallest of the supported GPUs.
    const SM80_OPTIN: usize = 163 * 1024;

    #[test]
    fn fused_plan_covers_every_position_with_whole_teams() {
        for n in [
            1, 2, 31, 32, 33, 100, 128, 512, 513, 1000, 2048, 4096, 8192, 8193, 20000,
        ] {
            for (off, batch) in [(false, 1), (true, 1), (false, 512), (true, 512)] {
                let p = Fused::plan(n, batch, off);
                let team = 32 * p.team_warps;
                assert!(p.chunk * team >= n, "n {n}: {p:?} leaves positions out");
                assert!(p.chunk >= 1 && p.teams >= 1 && p.block == p.teams * team);
                assert!(
                    p.block <= 512,
                    "n {n}: {p:?} exceeds the kernel's launch bound"
                );
                assert!(p.team_warps.is_power_of_two() && p.team_warps <= FUSED_MAX_WARPS);
            }
        }
    }

    #[test]
    fn fused_plans_fit_n_8192_on_every_supported_gpu_and_not_n_20000() {
        let p = Fused::plan(8192, 512, true);
        assert_eq!((p.team_warps, p.chunk, p.teams), (16, 16, 1));
        assert!(p.backward_shared_bytes() <= SM80_OPTIN, "{p:?}");
        // The fused backward holds a chunk in registers: every N up to 8192 qualifies.
        for n in [1, 100, 1000, 4097, 8192] {
            for batch in [1, 512] {
                assert!(Fused::plan(n, batch, true).chunk <= FUSED_CHUNK, "n {n}");
            }
        }
        assert!(Fused::plan(8193, 1, true).chunk > FUSED_CHUNK);
        // H100 / H200 opt in to 227 KiB: 20000 positions need more, the multi-launch path.
        assert!(Fused::plan(20000, 1, false).shared_bytes > 227 * 1024);
        // Short sequences share a block: 8 of 128 positions, 4 positions per thread.
        let p = Fused::plan(128, 512, false);
        assert_eq!((p.team_warps, p.chunk, p.teams, p.block), (1, 4, 8, 256));
        // A small call takes shorter chunks and wider teams; a large one the long chunks.
        let p = Fused::plan(512, 64, false);
        assert_eq!((p.team_warps, p.chunk, p.teams, p.block), (4, 4, 2, 256));
        let p = Fused::plan(512, 512, false);
        assert_eq!((p.team_warps, p.chunk, p.teams, p.block), (1, 16, 8, 256));
        // At N = 8192 the team is already as wide as the launch bound allows.
        assert_eq!(Fused::plan(8192, 1, false).chunk, 16);
    }

    #[test]
    fn warp_kernels_take_small_unit_calls_of_128_256_and_512() {
        assert_eq!(
            warp_kernel(128, 1, false, false),
            Some(Kernel::BkForwardWarp4)
        );
        assert_eq!(
            warp_kernel(256, 64, false, false),
            Some(Kernel::BkForwardWarp8)
        );
        assert_eq!(
            warp_kernel(512, 256, false, true),
            Some(Kernel::BkBackwardWarp16)
        );
        // Off-diagonals, other lengths and calls too large for one warp's chain go elsewhere.
        assert_eq!(warp_kernel(128, 1, true, false), None);
        assert_eq!(warp_kernel(100, 1, false, true), None);
        assert_eq!(warp_kernel(2048, 1, false, false), None);
        assert_eq!(warp_kernel(512, 512, false, true), None);
        assert_eq!(
            warp_kernel(128, 1024, false, true),
            Some(Kernel::BkBackwardWarp4)
        );
        assert_eq!(warp_kernel(128, 1025, false, false), None);
    }

    #[test]
    fn long_plans_take_the_longest_chunk_that_fills_the_gpu() {
        let p = |n, batch, bwd| Long::plan(n, batch, false, bwd);
        // The benchmark's two large sizes.
        let f = p(8192, 512, false).unwrap();
        assert_eq!((f.chunk, f.block, f.seqs), (64, 128, 1));
        let f = p(2048, 512, false).unwrap();
        assert_eq!(
            (f.chunk, f.block, f.seqs, f.kernel()),
            (16, 128, 1, Kernel::BkForwardLong16)
        );
        let b = p(8192, 512, true).unwrap();
        assert_eq!(
            (b.chunk, b.block, b.kernel()),
            (32, 256, Kernel::BkBackwardLong32)
        );
        // Short sequences share a block; smaller calls take shorter chunks as far as the
        // block bound allows.
        let f = p(2048, 128, false).unwrap();
        assert_eq!((f.chunk, f.block, f.seqs), (16, 128, 1));
        let f = p(4096, 64, false).unwrap();
        assert_eq!((f.chunk, f.block, f.seqs), (16, 256, 1));
        let f = p(2048, 2048, false).unwrap();
        assert_eq!((f.chunk, f.block, f.seqs), (64, 128, 4));
        // Not taken: off-diagonals, small calls, lengths that are not whole warps of chunks.
        assert!(Long::plan(8192, 512, true, false).is_none());
        assert!(p(2048, 64, false).is_none());
        assert!(p(3000, 512, false).is_none());
        assert!(p(256, 4096, false).is_none());
        for (n, batch) in [(2048, 65), (4096, 33), (8192, 17), (16384, 9), (8192, 512)] {
            for bwd in [false, true] {
                let l = p(n, batch, bwd).unwrap();
                assert!(n.is_multiple_of(32 * l.chunk));
                assert!(l.block.is_multiple_of(n / l.chunk) && l.block <= 512);
                assert!(l.shared_bytes <= 227 * 1024, "{l:?}");
            }
        }
    }

    /// The identity the long-chunk kernels rest on: with unit off-diagonals the q map of a
    /// chunk (F_lo ... F_hi-1, applied to q_hi) is J R^T J of its r map (F_hi-1 ... F_lo,
    /// applied to r_lo-1), and the two maps applied to (1, 0) give the plain recurrences'
    /// pivots.
    #[test]
    fn a_chunks_q_map_is_j_r_transpose_j_of_its_r_map() {
        use crate::engine::cpu::bk_core::Cx;
        type M = [[Cx<f64>; 2]; 2];
        let c = |re: f64| Cx::new(re, 0.0);
        let mm = |a: &M, b: &M| -> M {
            let e = |i: usize, j: usize| a[i][0] * b[0][j] + a[i][1] * b[1][j];
            [[e(0, 0), e(0, 1)], [e(1, 0), e(1, 1)]]
        };
        let step = |s: Cx<f64>| -> M { [[s, c(-1.0)], [c(1.0), c(0.0)]] };
        let z = Cx::new(0.3, 0.7);
        // A mixed-sign potential: s_i = -2 + v_i - z.
        let s: Vec<Cx<f64>> = (0..24)
            .map(|i| Cx::new(-2.0 + ((i * 37 % 11) as f64 - 5.0) * 0.6 - z.re, -z.im))
            .collect();
        let id: M = [[c(1.0), c(0.0)], [c(0.0), c(1.0)]];
        let r_map = s.iter().fold(id, |m, &si| mm(&step(si), &m));
        let q_map = s.iter().rev().fold(id, |m, &si| mm(&step(si), &m));
        let jrtj: M = [[r_map[0][0], -r_map[1][0]], [-r_map[0][1], r_map[1][1]]];
        let size = |x: Cx<f64>| x.re.abs().max(x.im.abs());
        let scale = r_map.iter().flatten().map(|&x| size(x)).fold(0.0, f64::max);
        for i in 0..2 {
            for j in 0..2 {
                let d = size(q_map[i][j] - jrtj[i][j]);
                assert!(d <= 1e-12 * scale, "entry ({i}, {j}) differs by {d}");
            }
        }
        // The plain recurrences: r from the left, q from the right.
        let r_last = s[1..].iter().fold(s[0], |r, &si| si - r.recip());
        let q_first = s[..s.len() - 1]
            .iter()
            .rev()
            .fold(s[s.len() - 1], |q, &si| si - q.recip());
        let close = |a: Cx<f64>, b: Cx<f64>| size(a - b) <= 1e-12 * size(b);
        assert!(close(r_map[0][0] * r_map[1][0].recip(), r_last));
        assert!(close(q_map[0][0] * q_map[1][0].recip(), q_first));
    }
}

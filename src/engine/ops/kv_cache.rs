//! The key/value cache of generation: appends (plain and with the norm folded in), the cache
//! attention of decode and prefill, the appending attention of a decode step, slot copies.

use super::*;

/// The rows of one call into a layer's key/value cache (a prefill, or a decode step), as every
/// layer's cache ops read them: their slots and positions, copied to the GPU once for all the
/// layers when they come from the host, and a GPU prefill's runs ([`PrefillRuns`]), found and
/// copied once. Host ids stay at hand for the ops' checks and for the CPU.
pub struct CacheRows<'a> {
    slot: Ids<'a>,
    pos: Ids<'a>,
    /// Device copies of host `slot` and `pos` (on a GPU).
    device: Option<(CudaSlice<u32>, CudaSlice<u32>)>,
    prefill: Option<PrefillRuns>,
}

impl<'a> CacheRows<'a> {
    /// The rows `slot`, `pos` of a call whose tensors live where `like` does, into a cache of
    /// heads of `head_dim`.
    pub fn new(like: &Tensor, slot: Ids<'a>, pos: Ids<'a>, head_dim: usize) -> Result<Self> {
        let mut prefill = PrefillRuns::of(like, slot, pos, head_dim);
        let mut device = None;
        if let On::Gpu(g) = device_of("cache_rows", &[like])? {
            if let (Some(s), Some(p)) = (slot.host(), pos.host()) {
                device = Some((g.upload(s)?, g.upload(p)?));
            }
            if let Some(runs) = &mut prefill {
                runs.device = Some((g.upload(&runs.runs)?, g.upload(&runs.padded_row)?));
            }
        }
        Ok(CacheRows {
            slot,
            pos,
            device,
            prefill,
        })
    }

    /// Rows with slots and positions on the host, where `like` lives.
    pub fn host(like: &Tensor, slot: &'a [u32], pos: &'a [u32], head_dim: usize) -> Result<Self> {
        CacheRows::new(like, Ids::Host(slot), Ids::Host(pos), head_dim)
    }

    /// Slots and positions where a GPU kernel reads them, uploaded only if no copy was made.
    pub(super) fn gpu(&self, g: &CudaBackend) -> Result<(GpuIds<'_>, GpuIds<'_>)> {
        Ok(match &self.device {
            Some((s, p)) => (GpuIds::Borrowed(s), GpuIds::Borrowed(p)),
            None => (gpu_ids(g, self.slot)?, gpu_ids(g, self.pos)?),
        })
    }
}

/// The GPU kernels read and write every tensor of a call in one element type.
pub(super) fn same_dtype(op: &'static str, ts: &[&Tensor]) -> Result<()> {
    match ts.iter().find(|t| t.dtype() != ts[0].dtype()) {
        Some(t) => Err(EngineError::Shape {
            op,
            detail: format!(
                "expects tensors of one dtype, got {:?} and {:?}",
                ts[0].dtype(),
                t.dtype()
            ),
        }),
        None => Ok(()),
    }
}

/// Rotates the queries and keys of `qkv[rows, (H+2K) D]` by each row's position, stores keys
/// and values into the cache at `(slot, pos)` and returns the rotated queries `[rows, H D]`.
/// See [`cpu::kv_cache`].
#[allow(clippy::too_many_arguments)]
pub fn kv_append(
    qkv: &Tensor,
    k_cache: &mut Tensor,
    v_cache: &mut Tensor,
    slot: &[u32],
    pos: &[u32],
    cos: &Tensor,
    sin: &Tensor,
    s: RopeShape,
    c: CacheShape,
) -> Result<Tensor> {
    profile::label("kv_append", qkv);
    let rows = CacheRows::host(qkv, slot, pos, c.head_dim)?;
    kv_append_at(qkv, k_cache, v_cache, &rows, cos, sin, s, c)
}

/// [`kv_append`] with slots and positions where the kernel reads them; device rows outside
/// the cache write nothing there and give NaN queries.
#[allow(clippy::too_many_arguments)]
pub fn kv_append_at(
    qkv: &Tensor,
    k_cache: &mut Tensor,
    v_cache: &mut Tensor,
    rows: &CacheRows,
    cos: &Tensor,
    sin: &Tensor,
    s: RopeShape,
    c: CacheShape,
) -> Result<Tensor> {
    append(qkv, None, None, k_cache, v_cache, rows, cos, sin, s, c)
}

/// [`kv_append_at`] of `qkv`, the projection of an unnormalised stream `x` (`[rows, C]`)
/// through a weight with its RMSNorm gain folded in: each row of `qkv` is first scaled by
/// `1 / sqrt(mean(x_row^2) + eps)`, which makes it the projection of `rmsnorm(x) * gain`, and
/// then given the projection's `bias` (`[qkv width]`), which the product therefore leaves out.
/// One kernel where a norm and an append were two (the decode step's, see
/// `models::llama`).
#[allow(clippy::too_many_arguments)]
pub fn kv_append_normed_at(
    qkv: &Tensor,
    x: &Tensor,
    eps: f32,
    bias: Option<&Tensor>,
    k_cache: &mut Tensor,
    v_cache: &mut Tensor,
    rows: &CacheRows,
    cos: &Tensor,
    sin: &Tensor,
    s: RopeShape,
    c: CacheShape,
) -> Result<Tensor> {
    append(
        qkv,
        Some((x, eps)),
        bias,
        k_cache,
        v_cache,
        rows,
        cos,
        sin,
        s,
        c,
    )
}

/// Checks `norm`'s stream against `rows` and returns its width.
pub(super) fn norm_width(
    op: &'static str,
    norm: Option<(&Tensor, f32)>,
    rows: usize,
) -> Result<usize> {
    let Some((x, _)) = norm else { return Ok(0) };
    let (xr, c) = rows_cols(op, x)?;
    if xr != rows || c == 0 {
        return Err(EngineError::Shape {
            op,
            detail: format!("a stream of {xr} rows of {c} for {rows} projected rows"),
        });
    }
    Ok(c)
}

#[allow(clippy::too_many_arguments)]
fn append(
    qkv: &Tensor,
    norm: Option<(&Tensor, f32)>,
    bias: Option<&Tensor>,
    k_cache: &mut Tensor,
    v_cache: &mut Tensor,
    rows: &CacheRows,
    cos: &Tensor,
    sin: &Tensor,
    s: RopeShape,
    c: CacheShape,
) -> Result<Tensor> {
    let (slot, pos) = (rows.slot, rows.pos);
    let op = if norm.is_some() {
        "kv_append_normed"
    } else {
        "kv_append"
    };
    let _prof = profile::scope(op, qkv);
    let on = {
        let mut all = vec![qkv, &*k_cache, &*v_cache, cos, sin];
        all.extend(norm.map(|(x, _)| x));
        all.extend(bias);
        device_of(op, &all)?
    };
    let width = check_append(
        op, qkv, norm, bias, k_cache, v_cache, slot, pos, cos, sin, s, c,
    )?;
    let mut q = Tensor::uninit(qkv.pool(), &[s.rows, s.heads * s.head_dim], act_dtype(qkv))?;
    match on {
        On::Meta => {}
        On::Cpu => cpu_append(
            op,
            q.host_mut(),
            qkv,
            norm.map(|(x, eps)| (x, eps, width)),
            bias,
            k_cache,
            v_cache,
            slot,
            pos,
            cos,
            sin,
            s,
            c,
        )?,
        On::Gpu(g) => {
            same_dtype(op, &[qkv, &*k_cache, &*v_cache])?;
            let (d_slot, d_pos) = rows.gpu(&g)?;
            match norm {
                None => with_elem!(qkv.dtype(), T => g.kv_append::<T>(
                    q.cuda_mut(),
                    k_cache.cuda_mut(),
                    v_cache.cuda_mut(),
                    qkv.cuda(),
                    d_slot.get(),
                    d_pos.get(),
                    cos.cuda(),
                    sin.cuda(),
                    s,
                    c,
                ))?,
                Some((x, eps)) => {
                    same_dtype(op, &[qkv, x])?;
                    if let Some(b) = bias {
                        same_dtype(op, &[qkv, b])?;
                    }
                    with_elem!(qkv.dtype(), T => g.kv_append_normed::<T>(
                        q.cuda_mut(),
                        k_cache.cuda_mut(),
                        v_cache.cuda_mut(),
                        qkv.cuda(),
                        x.cuda(),
                        width,
                        eps,
                        bias.map(|b| b.cuda()),
                        d_slot.get(),
                        d_pos.get(),
                        cos.cuda(),
                        sin.cuda(),
                        s,
                        c,
                    ))?
                }
            }
        }
    }
    Ok(q)
}

/// Checks an append's operands against its shapes (bias, tables, cache, rows, the norm's
/// stream); returns the stream's width (0 without a norm).
#[allow(clippy::too_many_arguments)]
fn check_append(
    op: &'static str,
    qkv: &Tensor,
    norm: Option<(&Tensor, f32)>,
    bias: Option<&Tensor>,
    k_cache: &Tensor,
    v_cache: &Tensor,
    slot: Ids,
    pos: Ids,
    cos: &Tensor,
    sin: &Tensor,
    s: RopeShape,
    c: CacheShape,
) -> Result<usize> {
    if let Some(b) = bias {
        expect_len(op, "bias", b, s.qkv_width())?;
    }
    if let Some(p) = pos.host() {
        check_rope(op, p, cos, sin, s)?;
    }
    check_cache(op, k_cache, v_cache, slot, pos, c)?;
    expect_len(op, "qkv", qkv, s.rows * s.qkv_width())?;
    if pos.len() != s.rows {
        return Err(EngineError::Shape {
            op,
            detail: format!("{} positions for {} rows", pos.len(), s.rows),
        });
    }
    norm_width(op, norm, s.rows)
}

/// The CPU append into `q` (host values): the projection, first scaled by each row's norm
/// factor of `norm`'s stream (of `width`) and given the bias, when there is a norm.
#[allow(clippy::too_many_arguments)]
fn cpu_append(
    op: &'static str,
    q: &mut [f32],
    qkv: &Tensor,
    norm: Option<(&Tensor, f32, usize)>,
    bias: Option<&Tensor>,
    k_cache: &mut Tensor,
    v_cache: &mut Tensor,
    slot: Ids,
    pos: Ids,
    cos: &Tensor,
    sin: &Tensor,
    s: RopeShape,
    c: CacheShape,
) -> Result<()> {
    let scaled = norm.map(|(x, eps, width)| {
        let bias = bias.map(Tensor::host);
        cpu::rmsnorm::normed_rows(qkv.host(), s.qkv_width(), x.host(), width, eps, bias)
    });
    cpu::kv_cache::kv_append(
        q,
        k_cache.host_mut(),
        v_cache.host_mut(),
        scaled.as_deref().unwrap_or(qkv.host()),
        cpu_ids(op, slot)?,
        cpu_ids(op, pos)?,
        cos.host(),
        sin.host(),
        s,
        c,
    );
    Ok(())
}

fn check_cache(
    op: &'static str,
    k: &Tensor,
    v: &Tensor,
    slot: Ids,
    pos: Ids,
    c: CacheShape,
) -> Result<()> {
    expect_len(op, "k_cache", k, c.len())?;
    expect_len(op, "v_cache", v, c.len())?;
    let outside = |ids: Ids, bound: usize| {
        ids.host()
            .is_some_and(|v| v.iter().any(|&i| i as usize >= bound))
    };
    if slot.len() != pos.len() || outside(slot, c.slots) || outside(pos, c.max_len) {
        return Err(EngineError::Shape {
            op,
            detail: format!(
                "rows must name a slot below {} and a position below the cache length {}",
                c.slots, c.max_len
            ),
        });
    }
    Ok(())
}

/// Each row's rotated queries `q[rows, H D]` attend to positions `0..=pos` of its cache slot,
/// or to the `window` latest of them (0: no window): `[rows, H D]`.
#[allow(clippy::too_many_arguments)]
pub fn cache_attention(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    slot: &[u32],
    pos: &[u32],
    heads: usize,
    window: usize,
    c: CacheShape,
) -> Result<Tensor> {
    profile::label("cache_attention", q);
    let longest = pos.iter().map(|&p| p as usize + 1).max().unwrap_or(0);
    let rows = CacheRows::host(q, slot, pos, c.head_dim)?;
    cache_attention_at(q, k_cache, v_cache, &rows, heads, window, longest, c)
}

/// [`cache_attention`] with slots and positions where the kernel reads them. `longest`
/// bounds every row's position + 1 and only chooses how a GPU splits rows over blocks (the
/// arithmetic, and so the last bits of the result, follow the split): calls that must agree
/// bit for bit pass the same bound. Device rows outside the cache give NaN.
#[allow(clippy::too_many_arguments)]
pub fn cache_attention_at(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    rows: &CacheRows,
    heads: usize,
    window: usize,
    longest: usize,
    c: CacheShape,
) -> Result<Tensor> {
    let _prof = profile::scope("cache_attention", q);
    let on = device_of("cache_attention", &[q, k_cache, v_cache])?;
    let (slot, pos) = (rows.slot, rows.pos);
    check_cache("cache_attention", k_cache, v_cache, slot, pos, c)?;
    expect_len("cache_attention", "q", q, slot.len() * heads * c.head_dim)?;
    if c.kv_heads == 0 || !heads.is_multiple_of(c.kv_heads) {
        return Err(EngineError::Shape {
            op: "cache_attention",
            detail: format!("{heads} heads cannot share {} key/value heads", c.kv_heads),
        });
    }
    if let Some(p) = rows.prefill.as_ref().filter(|p| p.head_dim == c.head_dim) {
        return prefill_attention(on, q, k_cache, v_cache, p, heads, window, c);
    }
    let mut out = Tensor::uninit(q.pool(), q.shape(), act_dtype(q))?;
    match on {
        On::Meta => {}
        On::Cpu => cpu::kv_cache::cache_attention(
            out.host_mut(),
            q.host(),
            k_cache.host(),
            v_cache.host(),
            cpu_ids("cache_attention", slot)?,
            cpu_ids("cache_attention", pos)?,
            heads,
            window,
            c,
        ),
        On::Gpu(g) => {
            same_dtype("cache_attention", &[q, k_cache, v_cache])?;
            let (d_slot, d_pos) = rows.gpu(&g)?;
            with_elem!(q.dtype(), T => g.cache_attention::<T>(
                out.cuda_mut(),
                q.cuda(),
                k_cache.cuda(),
                v_cache.cuda(),
                d_slot.get(),
                d_pos.get(),
                heads,
                window,
                longest,
                c,
            ))?
        }
    }
    Ok(out)
}

/// The longest prompt of a prefill from which a GPU attends through the training attention:
/// below it the cache kernel, one block per row, has no tiles to fill.
const PREFILL_FLASH_FROM: usize = 16;

/// A GPU prefill's rows as runs, each one sequence's positions `0..len` in order, for the
/// training attention's tiles: a prompt's rows otherwise each walk their prefix of the cache
/// alone (about half the prefill's time at 64 prompts of 64 tokens).
pub(super) struct PrefillRuns {
    /// (slot, first row, length) per run.
    pub(super) runs: Vec<u32>,
    /// The longest run: the padded sequence length.
    pub(super) tmax: usize,
    /// Each row's row in the padded `[runs x tmax]` output.
    pub(super) padded_row: Vec<u32>,
    /// The head size the runs were found for (the attention's kernels must have it).
    pub(super) head_dim: usize,
    /// `runs` and `padded_row` on the GPU ([`CacheRows::new`] copies them once a call).
    pub(super) device: Option<(CudaSlice<u32>, CudaSlice<u32>)>,
}

impl PrefillRuns {
    /// The runs of a call whose rows (on the host) all form runs from position 0, on a GPU
    /// (or a meta pool standing in for one) whose attention takes `head_dim`, with a prompt
    /// at least [`PREFILL_FLASH_FROM`] long and at most half the padded rows padding; `None`
    /// leaves the call to the cache kernel.
    pub(super) fn of(q: &Tensor, slot: Ids, pos: Ids, head_dim: usize) -> Option<PrefillRuns> {
        if !matches!(q.device(), Device::Cuda(_))
            || !crate::engine::cuda::attention::has_kernel(head_dim, q.dtype())
        {
            return None;
        }
        let (slot, pos) = (slot.host()?, pos.host()?);
        let mut runs = Vec::new();
        let mut first = 0;
        while first < pos.len() {
            if pos[first] != 0 {
                return None;
            }
            let mut end = first + 1;
            while end < pos.len() && slot[end] == slot[first] && pos[end] as usize == end - first {
                end += 1;
            }
            runs.push((slot[first], first, end - first));
            first = end;
        }
        let tmax = runs.iter().map(|r| r.2).max()?;
        if tmax < PREFILL_FLASH_FROM || runs.len() * tmax > 2 * pos.len() {
            return None;
        }
        let padded_row = runs
            .iter()
            .enumerate()
            .flat_map(|(r, &(_, _, len))| (0..len).map(move |t| (r * tmax + t) as u32))
            .collect();
        let runs = runs
            .iter()
            .flat_map(|&(slot, first, len)| [slot, first as u32, len as u32])
            .collect();
        Some(PrefillRuns {
            runs,
            tmax,
            padded_row,
            head_dim,
            device: None,
        })
    }

    pub(super) fn count(&self) -> usize {
        self.runs.len() / 3
    }
}

/// [`cache_attention_at`] of a prefill's runs through the training attention: the queries and
/// the runs' cached keys and values packed as its fused input, padded to the longest run,
/// and the real rows gathered from its output. Each row attends to positions `0..=pos` of
/// its slot as the cache kernel's rows do (with the training attention's rounding).
#[allow(clippy::too_many_arguments)]
fn prefill_attention(
    on: On,
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    p: &PrefillRuns,
    heads: usize,
    window: usize,
    c: CacheShape,
) -> Result<Tensor> {
    const OP: &str = "prefill_attention";
    let width = heads * c.head_dim;
    let (n, tmax) = (p.count(), p.tmax);
    let mut packed = Tensor::uninit(q.pool(), &[n, tmax, 3 * width], act_dtype(q))?;
    match on {
        On::Meta => {}
        On::Cpu => {
            return Err(EngineError::Shape {
                op: OP,
                detail: "the packed prefill runs on a GPU only".into(),
            });
        }
        On::Gpu(g) => {
            same_dtype(OP, &[q, k_cache, v_cache])?;
            // CacheRows::new copies a GPU call's runs to the device.
            let Some((d_runs, _)) = &p.device else {
                return Err(EngineError::Shape {
                    op: OP,
                    detail: "the prefill's runs were found for another device".into(),
                });
            };
            with_elem!(q.dtype(), T => g.prefill_pack::<T>(
                packed.cuda_mut(),
                q.cuda(),
                k_cache.cuda(),
                v_cache.cuda(),
                &p.runs,
                d_runs,
                tmax,
                heads,
                c,
            ))?
        }
    }
    let s = AttnShape {
        batch: n,
        seq: tmax,
        heads,
        channels: width,
    };
    let (out, stats) = windowed_attention_forward(&packed, s, window)?;
    drop((packed, stats));
    let out = out.reshaped(&[n * tmax, width]);
    let padded = match &p.device {
        Some((_, rows)) => Ids::Device(rows),
        None => Ids::Host(&p.padded_row),
    };
    gather_rows_at(&out, padded, None)
}

/// [`kv_append_normed_at`] followed by [`cache_attention_at`] on the queries it rotates:
/// `[rows, H D]`. Where the rows name `distinct_slots` (a decode step, one row per sequence)
/// a GPU may do both in one kernel, the queries never stored (and the CPU keeps them outside
/// the pool); otherwise (a prefill, whose rows attend to each other's appends) the two ops
/// run in turn.
#[allow(clippy::too_many_arguments)]
pub fn cache_attention_append_at(
    qkv: &Tensor,
    x: &Tensor,
    eps: f32,
    bias: Option<&Tensor>,
    k_cache: &mut Tensor,
    v_cache: &mut Tensor,
    rows: &CacheRows,
    cos: &Tensor,
    sin: &Tensor,
    s: RopeShape,
    window: usize,
    longest: usize,
    distinct_slots: bool,
    c: CacheShape,
) -> Result<Tensor> {
    if !distinct_slots {
        let q = kv_append_normed_at(qkv, x, eps, bias, k_cache, v_cache, rows, cos, sin, s, c)?;
        return cache_attention_at(&q, k_cache, v_cache, rows, s.heads, window, longest, c);
    }
    let shape = [s.rows, s.heads * s.head_dim];
    let mut out = Tensor::uninit(qkv.pool(), &shape, act_dtype(qkv))?;
    let cache = (k_cache, v_cache);
    cache_attention_append_into(
        &mut out, qkv, x, eps, bias, cache, rows, cos, sin, s, window, longest, c,
    )?;
    Ok(out)
}

/// [`cache_attention_append_at`] of a decode step (rows naming distinct slots) into `out`
/// (`[rows, H D]` in the activation dtype): a step that keeps its buffers, so that its kernels
/// follow each other with no allocation between them.
#[allow(clippy::too_many_arguments)]
pub fn cache_attention_append_into(
    out: &mut Tensor,
    qkv: &Tensor,
    x: &Tensor,
    eps: f32,
    bias: Option<&Tensor>,
    (k_cache, v_cache): (&mut Tensor, &mut Tensor),
    rows: &CacheRows,
    cos: &Tensor,
    sin: &Tensor,
    s: RopeShape,
    window: usize,
    longest: usize,
    c: CacheShape,
) -> Result<()> {
    const OP: &str = "cache_attention_append";
    let on = {
        let mut all = vec![qkv, x, &*k_cache, &*v_cache, cos, sin, &*out];
        all.extend(bias);
        device_of(OP, &all)?
    };
    let (slot, pos) = (rows.slot, rows.pos);
    let _prof = profile::scope(OP, qkv);
    let norm = Some((x, eps));
    let width = check_append(
        OP, qkv, norm, bias, k_cache, v_cache, slot, pos, cos, sin, s, c,
    )?;
    if s.kv_heads == 0 || !s.heads.is_multiple_of(s.kv_heads) || s.kv_heads != c.kv_heads {
        return Err(EngineError::Shape {
            op: OP,
            detail: format!(
                "{} heads over {} key/value heads, a cache of {}",
                s.heads, s.kv_heads, c.kv_heads
            ),
        });
    }
    let dtype = act_dtype(qkv);
    expect_len(OP, "output", out, s.rows * s.heads * s.head_dim)?;
    expect_act_output(OP, out, qkv)?;
    // Only the output is booked, on every device: the GPU kernel never stores the queries,
    // and the CPU keeps them outside the pool, so a meta pool's plan is each device's peak.
    if matches!(on, On::Meta) {
        // A GPU call of many blocks runs the two kernels, its queries taken from the driver.
        meta_scratch(qkv, out.len() * dtype.size_bytes());
    } else if matches!(on, On::Cpu) {
        let mut q = vec![0.0; s.rows * s.heads * s.head_dim];
        let normed = Some((x, eps, width));
        cpu_append(
            OP, &mut q, qkv, normed, bias, k_cache, v_cache, slot, pos, cos, sin, s, c,
        )?;
        cpu::kv_cache::cache_attention(
            out.host_mut(),
            &q,
            k_cache.host(),
            v_cache.host(),
            cpu_ids(OP, slot)?,
            cpu_ids(OP, pos)?,
            s.heads,
            window,
            c,
        );
    } else if let On::Gpu(g) = on {
        same_dtype(OP, &[qkv, x, &*k_cache, &*v_cache])?;
        if let Some(b) = bias {
            same_dtype(OP, &[qkv, b])?;
        }
        let (d_slot, d_pos) = rows.gpu(&g)?;
        with_elem!(qkv.dtype(), T => g.cache_attention_append::<T>(
            out.cuda_mut(),
            k_cache.cuda_mut(),
            v_cache.cuda_mut(),
            qkv.cuda(),
            x.cuda(),
            width,
            eps,
            bias.map(|b| b.cuda()),
            d_slot.get(),
            d_pos.get(),
            cos.cuda(),
            sin.cuda(),
            s,
            window,
            longest,
            c,
        ))?;
    }
    Ok(())
}

/// Copies positions `0..len` of cache slot `from` into slot `to` (samples sharing a prompt's
/// prefill).
pub fn copy_cache_slot(
    cache: &mut Tensor,
    from: usize,
    to: usize,
    len: usize,
    c: CacheShape,
) -> Result<()> {
    profile::label("copy_cache_slot", cache);
    expect_len("copy_cache_slot", "cache", cache, c.len())?;
    if from >= c.slots || to >= c.slots || len > c.max_len {
        return Err(EngineError::Shape {
            op: "copy_cache_slot",
            detail: format!(
                "slots {from} -> {to} of {}, {len} positions of {}",
                c.slots, c.max_len
            ),
        });
    }
    match device_of("copy_cache_slot", &[cache])? {
        On::Meta => {}
        On::Cpu => {
            let data = cache.host_mut();
            for h in 0..c.kv_heads {
                let (src, dst) = (c.at(from, h, 0), c.at(to, h, 0));
                data.copy_within(src..src + len * c.head_dim, dst);
            }
        }
        On::Gpu(g) => with_elem!(cache.dtype(), T => g.copy_cache_slot::<T>(
            cache.cuda_mut(),
            from,
            to,
            len,
            c,
        ))?,
    }
    Ok(())
}

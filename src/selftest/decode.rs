//! Generation's kernels: the key/value cache (append, attention, the appending attention),
//! the few-row products of a decode step, and the GPU sampler.

use super::*;

pub(super) const SAMPLE_BOUND: f64 = 2e-2;

/// The sampler's cases: name, settings, whether rows map to shared logits rows, and the
/// logits' scale.
pub(super) fn sample_cases() -> Vec<(&'static str, cpu::sampling::SampleParams, bool, f32)> {
    use cpu::sampling::SampleParams;
    let plain = SampleParams {
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        repetition_penalty: 1.0,
    };
    // Temperature 0.9 and top-p 0.9 (with top-k where it is not 0) on logits within `scale`.
    let nearly_flat = |name, top_k, scale| {
        let p = SampleParams {
            temperature: 0.9,
            top_k,
            top_p: 0.9,
            ..plain
        };
        (name, p, false, scale)
    };
    vec![
        (
            "greedy pen1.3",
            SampleParams {
                temperature: 0.0,
                repetition_penalty: 1.3,
                ..plain
            },
            false,
            6.0,
        ),
        (
            "T0.9 p0.9",
            SampleParams {
                temperature: 0.9,
                top_p: 0.9,
                ..plain
            },
            false,
            6.0,
        ),
        (
            "T0.7 k50 minp0.05 pen1.2",
            SampleParams {
                temperature: 0.7,
                top_k: 50,
                min_p: 0.05,
                repetition_penalty: 1.2,
                ..plain
            },
            false,
            6.0,
        ),
        ("T1 mapped", plain, true, 6.0),
        // Nearly flat logits (within 0.3: under a T/2, the fine value bins near the maximum)
        // and flatter still (within 0.003, one or two fine bins: thousands of candidates per row
        // and many equal logits, the contended path of the histograms and the threshold search
        // past the list in shared memory); with top-k as well, both cuts are searched among the
        // same candidates.
        nearly_flat("T0.9 p0.9 flatter", 0, 0.003),
        nearly_flat("T0.9 k50 p0.9 flatter", 50, 0.003),
        nearly_flat("T0.9 p0.9 flat", 0, 0.3),
        nearly_flat("T0.9 k50 p0.9 flat", 50, 0.3),
    ]
}

/// The rows of a decode step over some slots (padding rows naming no slot among them)
/// gathered on both devices; the error is the fraction of entries that differ.
pub(super) fn check_gather_slot_rows(gpu: &CudaBackend, inp: &mut Inputs) -> Check {
    use cpu::sampling::{HostSlots, gather_slot_rows};
    let slots = 50;
    let pos: Vec<u32> = (0..slots).map(|_| inp.0.next_u64() as u32 % 1000).collect();
    let mut host = HostSlots::new(pos, vec![7; slots], &[], 1000, 1000);
    host.tokens = (0..slots).map(|_| inp.0.next_u64() as u32 % 1000).collect();
    let ids: Vec<u32> = (0..37)
        .map(|i| {
            if i % 9 == 8 {
                u32::MAX
            } else {
                (i * 7 % slots) as u32
            }
        })
        .collect();
    let (mut want_t, mut want_p) = (vec![0u32; ids.len()], vec![0u32; ids.len()]);
    gather_slot_rows(&host, &ids, &mut want_t, &mut want_p);
    let dev = gpu.upload_slots(&host)?;
    let d_ids = gpu.upload(&ids)?;
    let mut got_t = gpu.upload(&vec![0xdead_beefu32; ids.len()])?;
    let mut got_p = gpu.upload(&vec![0xdead_beefu32; ids.len()])?;
    gpu.gather_slot_rows(&dev, &d_ids, &mut got_t, &mut got_p)?;
    let (got_t, got_p) = (gpu.download(&got_t)?, gpu.download(&got_p)?);
    let differ = (0..ids.len())
        .filter(|&i| got_t[i] != want_t[i] || got_p[i] != want_p[i])
        .count();
    Ok(differ as f64 / ids.len() as f64)
}

/// `rows` rows of random logits uniform within `scale` (6: peaked enough that top-p keeps a
/// part of the vocabulary; 0.3 and 0.003: nearly flat) drawn on
/// both devices from the same slot state, `per_call` rows per GPU call.
#[allow(clippy::too_many_arguments)]
pub(super) fn check_sample_rows<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    vocab: usize,
    (p, scale): (cpu::sampling::SampleParams, f32),
    mapped: bool,
    rows: usize,
    per_call: usize,
) -> Check {
    use cpu::sampling::{HostSlots, sample_rows};
    let stride = crate::models::padded_vocab(vocab);
    let logit_rows = if mapped { rows / 2 } else { rows };
    let logits = inp.uniform(logit_rows * stride, scale, T::DTYPE);
    let slots = rows + 3;
    let max_len = 50;
    let history: Vec<Vec<u32>> = (0..slots).map(|_| inp.tokens(40, vocab)).collect();
    let history: Vec<&[u32]> = history.iter().map(|h| &h[..]).collect();
    let pos: Vec<u32> = (0..slots).map(|i| (i % max_len) as u32).collect();
    let seeds: Vec<u64> = (0..slots).map(|_| inp.0.next_u64()).collect();
    let mut host = HostSlots::new(pos, seeds, &history, vocab, max_len);
    host.counters = (0..slots as u64).map(|i| i * 7).collect();
    let mut dev = gpu.upload_slots(&host)?;
    let (src, slot): (Vec<u32>, Vec<u32>) = if mapped {
        (0..rows as u32)
            .map(|r| (r / 2, (rows as u32 + 2) - r))
            .unzip()
    } else {
        ((0..rows as u32).collect(), (0..rows as u32).collect())
    };
    let (h_src, h_slot) = if mapped {
        (Some(&src[..]), Some(&slot[..]))
    } else {
        (None, None)
    };
    sample_rows(&logits, stride, h_src, h_slot, &mut host, &p, rows);
    let d_logits = gpu.upload_as::<T>(&logits)?;
    if per_call >= rows {
        let (d_src, d_slot) = (gpu.upload(&src)?, gpu.upload(&slot)?);
        gpu.sample_rows::<T>(
            &d_logits,
            stride,
            rows,
            mapped.then_some(&d_src),
            mapped.then_some(&d_slot),
            &mut dev,
            &p,
        )?;
    } else {
        // Fewer rows per call: each call names its rows' logits rows and slots.
        for (src, slot) in src.chunks(per_call).zip(slot.chunks(per_call)) {
            let (d_src, d_slot) = (gpu.upload(src)?, gpu.upload(slot)?);
            gpu.sample_rows::<T>(
                &d_logits,
                stride,
                src.len(),
                Some(&d_src),
                Some(&d_slot),
                &mut dev,
                &p,
            )?;
        }
    }
    let tokens = gpu.download(&dev.tokens)?;
    let logprobs = gpu.download(&dev.logprobs)?;
    let mut differ = 0usize;
    let mut lp_err = 0.0f64;
    for &s in &slot {
        let s = s as usize;
        if tokens[s] != host.tokens[s] {
            differ += 1;
        } else {
            let (g, w) = (logprobs[s] as f64, host.logprobs[s] as f64);
            lp_err = lp_err.max(if g.is_nan() {
                f64::INFINITY
            } else {
                (g - w).abs() / w.abs().max(1.0)
            });
        }
    }
    // Untouched slots keep their state; drawn ones advance exactly as on the host (a slot
    // whose token differs differs in its presence bit too, so masks are compared only where
    // tokens agree).
    let state_ok =
        gpu.download(&dev.pos)? == host.pos && gpu.download(&dev.counters)? == host.counters && {
            let words = cpu::sampling::mask_words(vocab);
            let mask = gpu.download(&dev.presence)?;
            (0..slots).all(|s| {
                tokens[s] != host.tokens[s]
                    || mask[s * words..(s + 1) * words] == host.presence[s * words..(s + 1) * words]
            })
        };
    if !state_ok {
        return Ok(f64::INFINITY);
    }
    Ok(worst(&[differ as f64 / rows as f64, lp_err]))
}

/// Cache positions of the key/value cache checks (decode positions reach 1500).
pub(super) const KV_MAX_LEN: usize = 1536;

/// The rows of a key/value cache check.
#[derive(Clone, Copy)]
pub(super) enum KvCall {
    /// Decode steps of this many sequences, each in its own slot at a random position below
    /// the second number; the first at its last position and, with more than two, the last at
    /// 2 (shorter than the number of splits, so some of its splits are empty).
    Decode(usize, usize),
    /// A prompt of this many tokens at positions 0.. of slot 1.
    Prefill(usize),
}

impl KvCall {
    /// The cache and each row's slot and position.
    pub(super) fn rows(
        self,
        inp: &mut Inputs,
        kv_heads: usize,
        head_dim: usize,
    ) -> (cpu::kv_cache::CacheShape, Vec<u32>, Vec<u32>) {
        let shape = |slots, max_len| cpu::kv_cache::CacheShape {
            slots,
            kv_heads,
            max_len,
            head_dim,
        };
        match self {
            KvCall::Decode(n, below) => {
                // Slots in a scrambled order (7 is coprime to any power of two).
                let slot = (0..n).map(|r| ((r * 7 + 3) % n) as u32).collect();
                let mut pos = inp.positions(n, below);
                pos[0] = below as u32 - 1;
                if n > 2 {
                    pos[n - 1] = 2;
                }
                (shape(n, KV_MAX_LEN), slot, pos)
            }
            KvCall::Prefill(n) => (shape(2, n + 5), vec![1; n], (0..n as u32).collect()),
        }
    }
}

/// A cache of NaN except positions `0..=pos` of each row's slot, which hold random values.
pub(super) fn kv_cache_input(
    inp: &mut Inputs,
    c: cpu::kv_cache::CacheShape,
    (slot, pos): (&[u32], &[u32]),
    dtype: DType,
) -> Vec<f32> {
    let mut cache = vec![f32::NAN; c.len()];
    let mut longest = vec![0usize; c.slots];
    for (&s, &p) in slot.iter().zip(pos) {
        longest[s as usize] = longest[s as usize].max(p as usize + 1);
    }
    for (s, &len) in longest.iter().enumerate() {
        for h in 0..c.kv_heads {
            let at = c.at(s, h, 0);
            let n = len * c.head_dim;
            cache[at..at + n].copy_from_slice(&inp.uniform(n, 1.0, dtype));
        }
    }
    cache
}

/// The error of a cache the GPU wrote against the CPU's: where the CPU's holds NaN (never
/// written) the GPU's must too, elsewhere the relative error.
fn cache_err(got: &[f32], want: &[f32]) -> f64 {
    if got.len() != want.len() {
        return f64::INFINITY;
    }
    let (mut g, mut w) = (Vec::new(), Vec::new());
    for (&a, &b) in got.iter().zip(want) {
        if b.is_nan() {
            if !a.is_nan() {
                return f64::INFINITY;
            }
        } else {
            g.push(a);
            w.push(b);
        }
    }
    rel_err(&g, &w, ELEMENTWISE_FLOOR)
}

/// Width of the unnormalised stream behind the normed kernels' checks (SmolLM2's).
pub(super) const NORMED_STREAM: usize = 576;

/// The append kernel, or with `normed` (`Some(with_bias)`) the folded decode step's append of
/// the projection of an unnormalised stream, each row scaled by its RMSNorm factor first and
/// given a bias after it when asked.
pub(super) fn check_kv_append<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    s: cpu::rope::RopeShape,
    c: cpu::kv_cache::CacheShape,
    (slot, pos): (&[u32], &[u32]),
    (cos, sin): (&[f32], &[f32]),
    normed: Option<bool>,
) -> Check {
    let qkv = inp.uniform(s.rows * s.qkv_width(), 1.0, T::DTYPE);
    // A stream of a few units, as a residual stream is: factors well away from one.
    let x = normed.map(|_| inp.uniform(s.rows * NORMED_STREAM, 4.0, T::DTYPE));
    let bias = (normed == Some(true)).then(|| inp.uniform(s.qkv_width(), 0.5, T::DTYPE));
    let eps = 1e-5;
    let projected = match &x {
        Some(x) => {
            cpu::rmsnorm::normed_rows(&qkv, s.qkv_width(), x, NORMED_STREAM, eps, bias.as_deref())
        }
        None => qkv.clone(),
    };
    let mut q = vec![0.0; s.rows * s.heads * s.head_dim];
    let (mut k, mut v) = (vec![f32::NAN; c.len()], vec![f32::NAN; c.len()]);
    cpu::kv_cache::kv_append(
        &mut q, &mut k, &mut v, &projected, slot, pos, cos, sin, s, c,
    );
    let mut d_q = poisoned::<T>(gpu, q.len())?;
    let mut d_k = poisoned::<T>(gpu, c.len())?;
    let mut d_v = poisoned::<T>(gpu, c.len())?;
    let (d_qkv, d_slot, d_pos) = (
        gpu.upload_as::<T>(&qkv)?,
        gpu.upload(slot)?,
        gpu.upload(pos)?,
    );
    let (d_cos, d_sin) = (gpu.upload(cos)?, gpu.upload(sin)?);
    match &x {
        None => gpu.kv_append(
            &mut d_q, &mut d_k, &mut d_v, &d_qkv, &d_slot, &d_pos, &d_cos, &d_sin, s, c,
        )?,
        Some(x) => {
            let d_bias = bias.as_ref().map(|b| gpu.upload_as::<T>(b)).transpose()?;
            gpu.kv_append_normed(
                &mut d_q,
                &mut d_k,
                &mut d_v,
                &d_qkv,
                &gpu.upload_as::<T>(x)?,
                NORMED_STREAM,
                eps,
                d_bias.as_ref(),
                &d_slot,
                &d_pos,
                &d_cos,
                &d_sin,
                s,
                c,
            )?
        }
    }
    Ok(worst(&[
        rel_err(&gpu.download_f32(&d_q)?, &q, ELEMENTWISE_FLOOR),
        cache_err(&gpu.download_f32(&d_k)?, &k),
        cache_err(&gpu.download_f32(&d_v)?, &v),
    ]))
}

pub(super) fn check_cache_attention<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    heads: usize,
    window: usize,
    c: cpu::kv_cache::CacheShape,
    (slot, pos): (&[u32], &[u32]),
) -> Check {
    let d = T::DTYPE;
    let k = kv_cache_input(inp, c, (slot, pos), d);
    let v = kv_cache_input(inp, c, (slot, pos), d);
    // Queries three times the keys' scale: scores spread over a few units, a peaked softmax.
    let q = inp.uniform(slot.len() * heads * c.head_dim, 3.0, d);
    let mut out = vec![0.0; q.len()];
    cpu::kv_cache::cache_attention(&mut out, &q, &k, &v, slot, pos, heads, window, c);
    let longest = pos.iter().map(|&p| p as usize + 1).max().unwrap_or(0);
    let mut d_out = poisoned::<T>(gpu, out.len())?;
    gpu.cache_attention(
        &mut d_out,
        &gpu.upload_as::<T>(&q)?,
        &gpu.upload_as::<T>(&k)?,
        &gpu.upload_as::<T>(&v)?,
        &gpu.upload(slot)?,
        &gpu.upload(pos)?,
        heads,
        window,
        longest,
        c,
    )?;
    Ok(rel_err(&gpu.download_f32(&d_out)?, &out, ELEMENTWISE_FLOOR))
}

/// The decode step's append and attention in one kernel against the CPU's append of the
/// normed projection and attention: the outputs and both caches.
#[allow(clippy::too_many_arguments)]
pub(super) fn check_cache_attention_append<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    s: cpu::rope::RopeShape,
    c: cpu::kv_cache::CacheShape,
    (slot, pos): (&[u32], &[u32]),
    (cos, sin): (&[f32], &[f32]),
    (with_bias, window): (bool, usize),
) -> Check {
    let d = T::DTYPE;
    let mut k = kv_cache_input(inp, c, (slot, pos), d);
    let mut v = kv_cache_input(inp, c, (slot, pos), d);
    let qkv = inp.uniform(s.rows * s.qkv_width(), 1.0, d);
    let x = inp.uniform(s.rows * NORMED_STREAM, 4.0, d);
    let bias = with_bias.then(|| inp.uniform(s.qkv_width(), 0.5, d));
    let eps = 1e-5;
    let (d_k0, d_v0) = (gpu.upload_as::<T>(&k)?, gpu.upload_as::<T>(&v)?);
    let projected =
        cpu::rmsnorm::normed_rows(&qkv, s.qkv_width(), &x, NORMED_STREAM, eps, bias.as_deref());
    let mut q = vec![0.0; s.rows * s.heads * s.head_dim];
    cpu::kv_cache::kv_append(
        &mut q, &mut k, &mut v, &projected, slot, pos, cos, sin, s, c,
    );
    // The kernel attends with the queries, keys and values rounded to the cache's type, as the
    // two kernels it replaces store them: so does the reference (the attention's output moves
    // by many of the type's steps with them, far past the elementwise bound).
    for t in [&mut q, &mut k, &mut v] {
        d.round_slice(t);
    }
    let longest = pos.iter().map(|&p| p as usize + 1).max().unwrap_or(0);
    let (mut d_k, mut d_v) = (d_k0, d_v0);
    let mut d_out = poisoned::<T>(gpu, q.len())?;
    let d_bias = bias.as_ref().map(|b| gpu.upload_as::<T>(b)).transpose()?;
    gpu.cache_attention_append(
        &mut d_out,
        &mut d_k,
        &mut d_v,
        &gpu.upload_as::<T>(&qkv)?,
        &gpu.upload_as::<T>(&x)?,
        NORMED_STREAM,
        eps,
        d_bias.as_ref(),
        &gpu.upload(slot)?,
        &gpu.upload(pos)?,
        &gpu.upload(cos)?,
        &gpu.upload(sin)?,
        s,
        window,
        longest,
        c,
    )?;
    // The appended keys and values are checked against the CPU's elementwise; the attention
    // against the CPU's over the keys and values the GPU appended. A key or value whose
    // unrounded f32 differs in its last bits between the two devices can round to the
    // neighbouring step of the cache's type (f16: 2^-11), and a value's step moves an output
    // near zero by far more than the elementwise bound allows of it.
    let (got_k, got_v) = (gpu.download_f32(&d_k)?, gpu.download_f32(&d_v)?);
    let mut out = vec![0.0; q.len()];
    cpu::kv_cache::cache_attention(&mut out, &q, &got_k, &got_v, slot, pos, s.heads, window, c);
    Ok(worst(&[
        rel_err(&gpu.download_f32(&d_out)?, &out, ELEMENTWISE_FLOOR),
        cache_err(&got_k, &k),
        cache_err(&got_v, &v),
    ]))
}

pub(super) fn check_copy_cache_slot<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    c: cpu::kv_cache::CacheShape,
) -> Check {
    let mut cache = inp.uniform(c.len(), 1.0, T::DTYPE);
    let mut d_cache = gpu.upload_as::<T>(&cache)?;
    let (from, to, len) = (2, 0, 257);
    for h in 0..c.kv_heads {
        let (src, dst) = (c.at(from, h, 0), c.at(to, h, 0));
        cache.copy_within(src..src + len * c.head_dim, dst);
    }
    gpu.copy_cache_slot(&mut d_cache, from, to, len, c)?;
    Ok(rel_err(
        &gpu.download_f32(&d_cache)?,
        &cache,
        ELEMENTWISE_FLOOR,
    ))
}

/// A call the few-row kernels must take: declining it fails the check.
fn few_rows_taken(op: &'static str, taken: bool) -> std::result::Result<(), CudaError> {
    if taken {
        Ok(())
    } else {
        Err(CudaError::Shape {
            op,
            detail: "the few-row kernels declined a shape they take".into(),
        })
    }
}

pub(super) fn check_few_rows_product<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    rows: usize,
    k: usize,
    n: usize,
    accumulate: bool,
) -> Check {
    let d = T::DTYPE;
    let (x, w, y0) = (
        inp.uniform(rows * k, 1.0, d),
        inp.uniform(n * k, 1.0, d),
        inp.uniform(rows * n, 4.0, d),
    );
    let mut want = vec![0.0; rows * n];
    cpu::gemm::linear_forward(&mut want, &x, &w, None, rows, k, n);
    if accumulate {
        want.iter_mut().zip(&y0).for_each(|(v, y)| *v += y);
    }
    let mut d_y = if accumulate {
        gpu.upload_as::<T>(&y0)?
    } else {
        poisoned::<T>(gpu, rows * n)?
    };
    let (d_x, d_w) = (gpu.upload_as::<T>(&x)?, gpu.upload_as::<T>(&w)?);
    let taken = gpu.few_rows_product(&mut d_y, &d_x, &d_w, rows, n, k, accumulate)?;
    few_rows_taken("few_rows_product", taken)?;
    Ok(rel_err(&gpu.download_f32(&d_y)?, &want, GEMM_FLOOR))
}

/// The CPU reference of the fused gate/up kernel: `silu(r gate) * (r up)`, `[gate | up] =
/// x[rows, k] w[2f, k]^T`, `r` each row's RMSNorm factor of `x`.
fn cpu_swiglu_normed(x: &[f32], w: &[f32], rows: usize, k: usize, f: usize, eps: f32) -> Vec<f32> {
    let mut gate_up = vec![0.0; rows * 2 * f];
    cpu::gemm::linear_forward(&mut gate_up, x, w, None, rows, k, 2 * f);
    let normed = cpu::rmsnorm::normed_rows(&gate_up, 2 * f, x, k, eps, None);
    let mut h = vec![0.0; rows * f];
    cpu::swiglu::swiglu_forward(&mut h, &normed, f);
    h
}

pub(super) fn check_few_rows_swiglu<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    rows: usize,
    k: usize,
    f: usize,
) -> Check {
    let d = T::DTYPE;
    let (x, w) = (
        inp.uniform(rows * k, 1.0, d),
        inp.uniform(2 * f * k, 1.0, d),
    );
    let eps = 1e-5;
    let want = cpu_swiglu_normed(&x, &w, rows, k, f, eps);
    let mut d_h = poisoned::<T>(gpu, rows * f)?;
    let (d_x, d_w) = (gpu.upload_as::<T>(&x)?, gpu.upload_as::<T>(&w)?);
    let taken = gpu.few_rows_swiglu(&mut d_h, &d_x, &d_w, rows, f, k, eps)?;
    few_rows_taken("few_rows_swiglu", taken)?;
    Ok(rel_err(&gpu.download_f32(&d_h)?, &want, GEMM_FLOOR))
}

/// Three decode MLP layers in a row (`h = swiglu(norm(x) [gate | up])`, `x += h down^T`), each
/// kernel reading the one before's output: launched overlapped they must give the bits of plain
/// launches (an input read before the previous kernel finished would differ), and both the
/// CPU's chain, rounded to `T` where the GPU stores.
pub(super) fn check_overlapped_chain<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    rows: usize,
    k: usize,
    f: usize,
) -> Check {
    const LAYERS: usize = 3;
    let d = T::DTYPE;
    let eps = 1e-5;
    let x0 = inp.uniform(rows * k, 1.0, d);
    // Weights scaled so the stream stays of order one through the layers.
    let layers: Vec<(Vec<f32>, Vec<f32>)> = (0..LAYERS)
        .map(|_| {
            let gate_up = inp.uniform(2 * f * k, 1.0 / (k as f32).sqrt(), d);
            let down = inp.uniform(k * f, 1.0 / (f as f32).sqrt(), d);
            (gate_up, down)
        })
        .collect();
    let mut want = x0.clone();
    for (gate_up, down) in &layers {
        let mut h = cpu_swiglu_normed(&want, gate_up, rows, k, f, eps);
        d.round_slice(&mut h);
        let mut y = vec![0.0; rows * k];
        cpu::gemm::linear_forward(&mut y, &h, down, None, rows, f, k);
        want.iter_mut()
            .zip(&y)
            .for_each(|(w, y)| *w = d.round(*w + y));
    }
    let weights = layers
        .iter()
        .map(|(gu, dn)| Ok((gpu.upload_as::<T>(gu)?, gpu.upload_as::<T>(dn)?)))
        .collect::<std::result::Result<Vec<_>, CudaError>>()?;
    let run = |overlapped: bool| -> std::result::Result<Vec<f32>, CudaError> {
        let _overlap = overlapped.then(|| gpu.overlapped());
        let mut x = gpu.upload_as::<T>(&x0)?;
        let mut h = poisoned::<T>(gpu, rows * f)?;
        for (gate_up, down) in &weights {
            let taken = gpu.few_rows_swiglu(&mut h, &x, gate_up, rows, f, k, eps)?;
            few_rows_taken("few_rows_swiglu", taken)?;
            let taken = gpu.few_rows_product(&mut x, &h, down, rows, k, f, true)?;
            few_rows_taken("few_rows_product", taken)?;
        }
        gpu.download_f32(&x)
    };
    let (plain, overlapped) = (run(false)?, run(true)?);
    if let Some(i) = (0..plain.len()).find(|&i| plain[i].to_bits() != overlapped[i].to_bits()) {
        return Err(CudaError::Shape {
            op: "few_rows chain (overlapped)",
            detail: format!(
                "overlapped launches gave {} at {i}, plain ones {}",
                overlapped[i], plain[i]
            ),
        });
    }
    Ok(rel_err(&overlapped, &want, GEMM_FLOOR))
}

//! Rotary position embeddings, expanded over grouped key/value heads.

use super::*;

pub(super) fn check_rope(
    op: &'static str,
    pos: &[u32],
    cos: &Tensor,
    sin: &Tensor,
    s: RopeShape,
) -> Result<()> {
    let half = s.rot_dim / 2;
    let bad = |detail: String| Err(EngineError::Shape { op, detail });
    if s.kv_heads == 0 || !s.heads.is_multiple_of(s.kv_heads) {
        return bad(format!(
            "{} query heads cannot share {} key/value heads evenly",
            s.heads, s.kv_heads
        ));
    }
    if !s.rot_dim.is_multiple_of(2) || s.rot_dim > s.head_dim {
        return bad(format!(
            "rotary dimensions {} must be even and at most the head size {}",
            s.rot_dim, s.head_dim
        ));
    }
    if pos.len() != s.rows {
        return bad(format!("{} positions for {} rows", pos.len(), s.rows));
    }
    let table_rows = cos.len().checked_div(half).unwrap_or(usize::MAX);
    if cos.len() != sin.len() || cos.dtype() != DType::F32 || sin.dtype() != DType::F32 {
        return bad("the cos and sin tables must be f32 of one shape".into());
    }
    if let Some(&p) = pos.iter().find(|&&p| p as usize >= table_rows) {
        return bad(format!(
            "position {p} is past the rotary table of {table_rows} positions (the model's context)"
        ));
    }
    Ok(())
}

/// Rotates the queries and keys of a grouped-query projection `qkv[rows, (H+2K) D]` by
/// each row's position and packs `[q | k | v]` with one key/value head per query head:
/// `[rows, 3 H D]`, the layout the attention kernels read. See [`cpu::rope`].
pub fn rope_expand_forward(
    qkv: &Tensor,
    pos: &[u32],
    cos: &Tensor,
    sin: &Tensor,
    s: RopeShape,
) -> Result<Tensor> {
    let _prof = profile::scope("rope_expand_forward", qkv);
    let on = device_of("rope_expand", &[qkv, cos, sin])?;
    check_rope("rope_expand", pos, cos, sin, s)?;
    expect_len("rope_expand", "qkv", qkv, s.rows * s.qkv_width())?;
    let mut shape = qkv.shape().to_vec();
    *shape
        .last_mut()
        .expect("expect_len checked a non-empty tensor") = s.packed_width();
    let mut out = Tensor::uninit(qkv.pool(), &shape, act_dtype(qkv))?;
    match on {
        On::Meta => meta_scratch(qkv, 4 * pos.len()),
        On::Cpu => cpu::rope::rope_expand_forward(
            out.host_mut(),
            qkv.host(),
            pos,
            cos.host(),
            sin.host(),
            s,
        ),
        On::Gpu(g) => {
            let d_pos = g.upload(pos)?;
            with_elem!(qkv.dtype(), T => g.rope_expand_forward::<T>(
                out.cuda_mut(),
                qkv.cuda(),
                &d_pos,
                cos.cuda(),
                sin.cuda(),
                s,
            ))?
        }
    }
    Ok(out)
}

/// The backward of [`rope_expand_forward`]: `dqkv[rows, (H+2K) D]` from `dpacked`.
pub fn rope_expand_backward(
    dpacked: &Tensor,
    pos: &[u32],
    cos: &Tensor,
    sin: &Tensor,
    s: RopeShape,
) -> Result<Tensor> {
    let _prof = profile::scope("rope_expand_backward", dpacked);
    let on = device_of("rope_expand_backward", &[dpacked, cos, sin])?;
    check_rope("rope_expand_backward", pos, cos, sin, s)?;
    expect_len(
        "rope_expand_backward",
        "dpacked",
        dpacked,
        s.rows * s.packed_width(),
    )?;
    let mut shape = dpacked.shape().to_vec();
    *shape
        .last_mut()
        .expect("expect_len checked a non-empty tensor") = s.qkv_width();
    let mut out = Tensor::uninit(dpacked.pool(), &shape, act_dtype(dpacked))?;
    match on {
        On::Meta => meta_scratch(dpacked, 4 * pos.len()),
        On::Cpu => cpu::rope::rope_expand_backward(
            out.host_mut(),
            dpacked.host(),
            pos,
            cos.host(),
            sin.host(),
            s,
        ),
        On::Gpu(g) => {
            let d_pos = g.upload(pos)?;
            with_elem!(dpacked.dtype(), T => g.rope_expand_backward::<T>(
                out.cuda_mut(),
                dpacked.cuda(),
                &d_pos,
                cos.cuda(),
                sin.cuda(),
                s,
            ))?
        }
    }
    Ok(out)
}

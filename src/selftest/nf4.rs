//! The `nf4` group: NF4 dequantisation bit for bit.

use super::*;

/// A weight for the NF4 checks: uniform values whose 64-value blocks span four decades of
/// scale (so the double-quantised absmax codes spread over the dynamic map), with every 97th
/// block all zeros.
fn nf4_weight(inp: &mut Inputs, n: usize) -> Vec<f32> {
    let mut values = inp.uniform(n, 1.0, DType::F32);
    for (b, block) in values.chunks_mut(cpu::nf4::BLOCK).enumerate() {
        let scale = if b % 97 == 5 {
            0.0
        } else {
            10f32.powi((b % 5) as i32 - 3)
        };
        block.iter_mut().for_each(|v| *v *= scale);
    }
    values
}

/// NF4 weights quantised into `pool` and expanded there into NaN-poisoned f32, bf16 and f16
/// workspaces, against the CPU reference on the host's quantisation of the same values: the
/// parts must arrive unchanged and every output value must be bit-identical. Shapes:
/// SmolLM2's MLP (576 x 1536, 54 groups of 256 blocks), Llama-3.2-1B's down projection
/// (2048 x 8192), a ragged one (37 x 91: the last block padded, the last packed word
/// partial) and a single short row.
pub(super) fn nf4_checks(
    pool: &Arc<MemoryPool>,
    inp: &mut Inputs,
) -> Vec<(String, std::result::Result<String, String>)> {
    let mut outcomes = Vec::new();
    for (rows, cols) in [(576, 1536), (2048, 8192), (37, 91), (1, 7)] {
        let n = rows * cols;
        let values = nf4_weight(inp, n);
        let reference = cpu::nf4::quantize(&values);
        let before = pool.stats().current;
        let weight = Nf4Weight::quantize(pool, "selftest weight", &values, rows, cols)
            .and_then(|w| Ok((w.to_host_parts()?, w)));
        let weight = match weight {
            Ok((parts, w)) if parts == reference => w,
            Ok(_) => {
                outcomes.push((
                    format!("nf4 quantize {rows}x{cols}"),
                    Err("the parts read back from the device differ from those uploaded".into()),
                ));
                continue;
            }
            Err(e) => {
                outcomes.push((format!("nf4 quantize {rows}x{cols}"), Err(e.to_string())));
                continue;
            }
        };
        let booked = pool.stats().current - before;
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let mut want = vec![0.0; n];
            cpu::nf4::dequantize(reference.view(), &mut want, dtype);
            let got = Tensor::from_vec(pool, &[rows, cols], dtype, vec![f32::NAN; n]).and_then(
                |mut t| {
                    weight.dequantize_into(&mut t)?;
                    t.to_vec()
                },
            );
            let outcome = match got {
                Err(e) => Err(e.to_string()),
                Ok(got) => {
                    let mut differ = got
                        .iter()
                        .zip(&want)
                        .enumerate()
                        .filter(|(_, (g, w))| g.to_bits() != w.to_bits());
                    match differ.next() {
                        None => Ok(format!(
                            "{n} values bit-identical to the CPU reference (weight books {booked} bytes, {:.3} per value)",
                            booked as f64 / n as f64
                        )),
                        Some((i, (g, w))) => Err(format!(
                            "{} of {n} values differ from the CPU reference, the first at {i}: {g} vs {w}",
                            1 + differ.count()
                        )),
                    }
                }
            };
            outcomes.push((
                format!("nf4_dequantize {:?} {rows}x{cols}", dtype).to_lowercase(),
                outcome,
            ));
        }
    }
    outcomes
}

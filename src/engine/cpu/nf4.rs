//! NF4 quantisation and its reference dequantisation, on host slices.
//!
//! The format (blocks of 64 values as 4-bit NormalFloat codes, each block scaled by its
//! absmax, the absmax values themselves quantised to 8 bits in blocks of 256) and where it
//! matches bitsandbytes are described in [`crate::engine::quant::nf4`]; this file holds the
//! arithmetic, which the CUDA kernel (`engine/cuda/nf4.cu`) reproduces bit for bit.

use crate::engine::DType;
use rayon::prelude::*;
use std::sync::OnceLock;

/// Values that share one absmax.
pub const BLOCK: usize = 64;
/// Packed bytes of one block (two codes a byte).
pub const BLOCK_BYTES: usize = BLOCK / 2;
/// Absmax codes that share one f32 scale (the second level of the double quantisation).
pub const ABSMAX_BLOCK: usize = 256;

/// The 16 NormalFloat values: quantiles of a standard normal scaled to [-1, 1], with an exact
/// zero (code 7). The f32 values of bitsandbytes' `get_4bit_type("nf4")`, written with its
/// decimals (which round to the same f32 values as there).
#[allow(clippy::excessive_precision)]
pub const NF4_CODE: [f32; 16] = [
    -1.0,
    -0.696_192_800_998_687_7,
    -0.525_073_051_452_636_7,
    -0.394_917_488_098_144_53,
    -0.284_441_381_692_886_35,
    -0.184_773_430_228_233_34,
    -0.091_050_036_251_544_95,
    0.0,
    0.079_580_299_556_255_34,
    0.160_930_201_411_247_25,
    0.246_112_301_945_686_34,
    0.337_915_241_718_292_24,
    0.440_709_829_330_444_34,
    0.562_617_003_917_694_1,
    0.722_956_836_223_602_3,
    1.0,
];

/// Decision thresholds between neighbouring codes, ascending: the midpoints of [`NF4_CODE`]
/// as bitsandbytes' quantiser writes them (f32 literals of the f64 midpoints). A scaled value
/// `x` gets the code `#{t : t < x}`, which is the decision tree of bitsandbytes' `dQuantizeNF4`
/// (every comparison there is `x > t`): the nearest code, with a value exactly on a threshold
/// going to the lower code.
#[allow(clippy::excessive_precision)]
const NF4_THRESHOLDS: [f32; 15] = [
    -0.848_096_400_499_343_9,
    -0.610_632_926_225_662_2,
    -0.459_995_269_775_390_6,
    -0.339_679_434_895_515_44,
    -0.234_607_405_960_559_84,
    -0.137_911_733_239_889_14,
    -0.045_525_018_125_772_476,
    0.039_790_149_778_127_67,
    0.120_255_250_483_751_3,
    0.203_521_251_678_466_8,
    0.292_013_771_831_989_3,
    0.389_312_535_524_368_3,
    0.501_663_416_624_069_2,
    0.642_786_920_070_648_2,
    0.861_478_418_111_801_1,
];

/// The NF4 code of a value already divided by its block's absmax (so in [-1, 1]).
#[inline]
pub fn nf4_code(x: f32) -> u8 {
    NF4_THRESHOLDS.partition_point(|&t| t < x) as u8
}

/// bitsandbytes' signed dynamic 8-bit map (`create_dynamic_map(signed=True)`), ascending: for
/// each decade `10^-6 .. 10^0` the midpoints of an f32 `linspace(0.1, 1, 2^i + 1)` times the
/// decade, both signs, then 0 and 1. Index 127 is 0.0, index 255 is 1.0; the most negative
/// value is about -0.993 (there is no -1).
///
/// bitsandbytes builds the map with `torch.linspace` on the host, whose vectorised path rounds
/// some boundaries differently from its scalar path depending on the CPU; this is the scalar
/// path (`start + step * i` for the first half, `end - step * (steps - 1 - i)` for the
/// second), so an entry may differ from a given bitsandbytes installation's in its last bit.
/// A checkpoint written in bitsandbytes' layout carries the map (`nested_quant_map`), so a
/// reader decodes kiln's codes with kiln's map either way.
pub fn dynamic_map() -> &'static [f32; 256] {
    static MAP: OnceLock<[f32; 256]> = OnceLock::new();
    MAP.get_or_init(|| {
        // Python's `10 ** -k` as f64, rounded to f32 by torch's scalar multiply.
        const DECADES: [f64; 7] = [1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0];
        let mut values = Vec::with_capacity(256);
        for (i, &decade) in DECADES.iter().enumerate() {
            let bounds = linspace_f32(0.1, 1.0, (1 << i) + 1);
            let decade = decade as f32;
            for pair in bounds.windows(2) {
                let v = decade * ((pair[0] + pair[1]) / 2.0);
                values.push(v);
                values.push(-v);
            }
        }
        values.push(0.0);
        values.push(1.0);
        values.sort_by(f32::total_cmp);
        values
            .try_into()
            .expect("7 decades of 2^i values, both signs, 0 and 1")
    })
}

/// `torch.linspace(start, end, steps, dtype=float32)` as its scalar loop computes it.
fn linspace_f32(start: f32, end: f32, steps: usize) -> Vec<f32> {
    let step = (end - start) / (steps - 1) as f32;
    let half = steps / 2;
    (0..steps)
        .map(|i| {
            if i < half {
                start + step * i as f32
            } else {
                end - step * (steps - 1 - i) as f32
            }
        })
        .collect()
}

/// The 8-bit code of `x` in [-1, 1] in `map` (ascending, 256 entries): bitsandbytes'
/// `dQuantize` search, a 7-step bisection from index 127 followed by a comparison with the
/// midpoint to the neighbour on the side of `x`. It finds the nearest entry; a value exactly on
/// that midpoint stays with the final pivot.
pub fn dynamic_code(map: &[f32; 256], x: f32) -> u8 {
    let (mut pivot, mut upper_pivot, mut lower_pivot) = (127usize, 255usize, 0usize);
    let (mut lower, mut upper) = (-1.0f32, 1.0f32);
    let mut val = map[pivot];
    let mut step = 64;
    while step > 0 {
        if x > val {
            lower_pivot = pivot;
            lower = val;
            pivot += step;
        } else {
            upper_pivot = pivot;
            upper = val;
            pivot -= step;
        }
        val = map[pivot];
        step >>= 1;
    }
    if upper_pivot == 255 {
        upper = map[255];
    }
    if lower_pivot == 0 {
        lower = map[0];
    }
    let chosen = if x > val {
        if x > (upper + val) * 0.5 {
            upper_pivot
        } else {
            pivot
        }
    } else if x < (lower + val) * 0.5 {
        lower_pivot
    } else {
        pivot
    };
    chosen as u8
}

/// Number of 64-value blocks of `n` values (the last one padded with zeros).
pub fn blocks(n: usize) -> usize {
    n.div_ceil(BLOCK)
}

/// Number of f32 second-level scales for `blocks` absmax codes.
pub fn absmax_scales(blocks: usize) -> usize {
    blocks.div_ceil(ABSMAX_BLOCK)
}

/// A quantised tensor on the host, in the layout of [`crate::engine::quant::nf4`].
#[derive(Debug, Clone, PartialEq)]
pub struct Nf4Parts {
    /// `blocks * 32` bytes: value `i` in byte `i / 2`, the high nibble for even `i`.
    pub packed: Vec<u8>,
    /// One 8-bit code of [`dynamic_map`] per block: its absmax, less `offset`, over its scale.
    pub absmax_codes: Vec<u8>,
    /// One f32 per 256 absmax codes: the largest `|absmax - offset|` among them.
    pub absmax_scales: Vec<f32>,
    /// The mean of all blocks' absmax values.
    pub offset: f32,
}

/// Borrowed parts, as the dequantisation reads them.
#[derive(Debug, Clone, Copy)]
pub struct Nf4View<'a> {
    pub packed: &'a [u8],
    pub absmax_codes: &'a [u8],
    pub absmax_scales: &'a [f32],
    pub offset: f32,
}

impl Nf4Parts {
    pub fn view(&self) -> Nf4View<'_> {
        Nf4View {
            packed: &self.packed,
            absmax_codes: &self.absmax_codes,
            absmax_scales: &self.absmax_scales,
            offset: self.offset,
        }
    }
}

impl Nf4View<'_> {
    /// The absmax of block `b` as the double quantisation restores it:
    /// `map[code] * scale + offset`, two f32 roundings (no fused multiply-add), as
    /// bitsandbytes' `dequantize_blockwise` followed by `absmax += offset` computes it.
    #[inline]
    pub fn block_absmax(&self, b: usize) -> f32 {
        let restored =
            dynamic_map()[self.absmax_codes[b] as usize] * self.absmax_scales[b / ABSMAX_BLOCK];
        restored + self.offset
    }
}

/// Quantises `values` (all finite; the caller checks and names the tensor) to NF4 with
/// double-quantised absmax values, in parallel over blocks.
///
/// Per block: `absmax = max |v|`, then each value's code is [`nf4_code`] of `v * (1 / absmax)`
/// (bitsandbytes multiplies by the f32 reciprocal; so does this). A block of zeros (absmax 0)
/// gets code 7, the exact zero, for every value; bitsandbytes computes `0 * inf = NaN` there,
/// which its tree sends to code 0, and decodes it as `-1 * absmax`, also zero up to the
/// double quantisation's error. Padding past `values.len()` is quantised as 0.0.
///
/// Then the absmax values: `offset` is their mean (accumulated in f64), and each group of 256
/// is scaled by its largest `|absmax - offset|` and coded with [`dynamic_code`] (a group whose
/// centred values are all zero gets code 127, 0.0, where bitsandbytes' reciprocal again
/// produces NaN and code 0; either decodes to `offset`).
pub fn quantize(values: &[f32]) -> Nf4Parts {
    let n_blocks = blocks(values.len());
    let mut packed = vec![0u8; n_blocks * BLOCK_BYTES];
    let mut absmax = vec![0f32; n_blocks];
    packed
        .par_chunks_mut(BLOCK_BYTES)
        .zip(absmax.par_iter_mut())
        .zip(values.par_chunks(BLOCK))
        .for_each(|((out, amax), block)| *amax = quantize_block(block, out));
    let offset = (absmax.iter().map(|&a| a as f64).sum::<f64>() / n_blocks.max(1) as f64) as f32;
    let map = dynamic_map();
    let mut absmax_codes = vec![0u8; n_blocks];
    let mut absmax_scales = vec![0f32; absmax_scales(n_blocks)];
    absmax_codes
        .par_chunks_mut(ABSMAX_BLOCK)
        .zip(absmax_scales.par_iter_mut())
        .zip(absmax.par_chunks(ABSMAX_BLOCK))
        .for_each(|((codes, scale), group)| {
            *scale = group.iter().fold(0f32, |m, &a| m.max((a - offset).abs()));
            let inv = reciprocal_or_zero(*scale);
            for (c, &a) in codes.iter_mut().zip(group) {
                *c = dynamic_code(map, (a - offset) * inv);
            }
        });
    Nf4Parts {
        packed,
        absmax_codes,
        absmax_scales,
        offset,
    }
}

/// `1 / x`, or 0 for a zero `x` so that an all-zero group codes to zero instead of NaN.
fn reciprocal_or_zero(x: f32) -> f32 {
    if x == 0.0 { 0.0 } else { 1.0 / x }
}

/// Codes one block of up to 64 values into 32 bytes and returns its absmax.
fn quantize_block(block: &[f32], out: &mut [u8]) -> f32 {
    let absmax = block.iter().fold(0f32, |m, &v| m.max(v.abs()));
    let inv = reciprocal_or_zero(absmax);
    let code = |i: usize| nf4_code(block.get(i).map_or(0.0, |&v| v * inv));
    for (k, byte) in out.iter_mut().enumerate() {
        *byte = (code(2 * k) << 4) | code(2 * k + 1);
    }
    absmax
}

/// The code of value `i` in `packed`: the high nibble of byte `i / 2` for even `i`.
#[inline]
pub fn packed_code(packed: &[u8], i: usize) -> u8 {
    let byte = packed[i / 2];
    if i.is_multiple_of(2) {
        byte >> 4
    } else {
        byte & 0x0f
    }
}

/// Writes the first `out.len()` values of `w`, rounded to `dtype` (the CPU keeps f32 values
/// rounded to the narrower type, see [`crate::engine::dtype`]): `round(NF4_CODE[code] *
/// absmax)` with the block's restored absmax. This is the reference of the CUDA kernel.
pub fn dequantize(w: Nf4View, out: &mut [f32], dtype: DType) {
    assert!(
        out.len() <= w.packed.len() * 2 && blocks(out.len()) <= w.absmax_codes.len(),
        "nf4 dequantize: {} values from {} packed bytes",
        out.len(),
        w.packed.len()
    );
    out.par_chunks_mut(BLOCK)
        .enumerate()
        .for_each(|(b, chunk)| {
            let absmax = w.block_absmax(b);
            let bytes = &w.packed[b * BLOCK_BYTES..];
            for (i, o) in chunk.iter_mut().enumerate() {
                *o = dtype.round(NF4_CODE[packed_code(bytes, i) as usize] * absmax);
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::rng::{Rng, stream};

    fn normal(n: usize, seed: u64, scale: f32) -> Vec<f32> {
        let mut r = Rng::new(seed, stream::INIT);
        (0..n).map(|_| r.normal() * scale).collect()
    }

    /// The f32 absmax of each block, straight from the values.
    fn true_absmax(values: &[f32]) -> Vec<f32> {
        values
            .chunks(BLOCK)
            .map(|b| b.iter().fold(0f32, |m, v| m.max(v.abs())))
            .collect()
    }

    fn dequantized(p: &Nf4Parts, n: usize, dtype: DType) -> Vec<f32> {
        let mut out = vec![f32::NAN; n];
        dequantize(p.view(), &mut out, dtype);
        out
    }

    fn code_at(p: &Nf4Parts, i: usize) -> usize {
        packed_code(&p.packed, i) as usize
    }

    #[test]
    fn thresholds_are_the_midpoints_of_the_codes() {
        for (i, t) in NF4_THRESHOLDS.iter().enumerate() {
            let mid = (NF4_CODE[i] as f64 + NF4_CODE[i + 1] as f64) / 2.0;
            assert!(
                (*t as f64 - mid).abs() < 1e-7,
                "threshold {i}: {t} vs {mid}"
            );
        }
        // Each code maps to itself, and a threshold itself goes to the lower code.
        for (i, &c) in NF4_CODE.iter().enumerate() {
            assert_eq!(nf4_code(c) as usize, i);
        }
        for (i, &t) in NF4_THRESHOLDS.iter().enumerate() {
            assert_eq!(nf4_code(t) as usize, i, "tie at threshold {i}");
            assert_eq!(
                nf4_code(f32::from_bits(t.to_bits() + 1)) as usize,
                if t > 0.0 { i + 1 } else { i }
            );
        }
        assert_eq!((nf4_code(-2.0), nf4_code(2.0)), (0, 15));
    }

    #[test]
    fn every_value_is_its_blocks_absmax_times_the_nearest_code() {
        // Rows x cols not a multiple of 64: the last block is padded.
        let (rows, cols) = (37, 91);
        let values = normal(rows * cols, 3, 0.02);
        let p = quantize(&values);
        let out = dequantized(&p, values.len(), DType::F32);
        let absmax = true_absmax(&values);
        for (i, &v) in values.iter().enumerate() {
            let b = i / BLOCK;
            let x = v * (1.0 / absmax[b]);
            let code = code_at(&p, i);
            // Nearest in exact arithmetic, up to the f32 rounding of the thresholds.
            let best = (0..16)
                .map(|c| (x as f64 - NF4_CODE[c] as f64).abs())
                .fold(f64::INFINITY, f64::min);
            let chosen = (x as f64 - NF4_CODE[code] as f64).abs();
            assert!(chosen <= best + 1e-7, "value {i}: {v} got code {code}");
            assert_eq!(
                out[i].to_bits(),
                (NF4_CODE[code] * p.view().block_absmax(b)).to_bits(),
                "value {i}"
            );
        }
        // Padding codes are the zero code.
        let n = values.len();
        for i in n..blocks(n) * BLOCK {
            assert_eq!(code_at(&p, i), 7, "padding {i}");
        }
    }

    #[test]
    fn nibble_order_is_high_first() {
        // Block absmax 1: the values are codes themselves.
        let mut values = vec![0.0f32; BLOCK];
        values[0] = 1.0;
        values[1] = -1.0;
        values[2] = NF4_CODE[9];
        let p = quantize(&values);
        assert_eq!(p.packed[0], 0xf0);
        assert_eq!(p.packed[1], 0x97);
        assert_eq!(p.packed.len(), BLOCK_BYTES);
    }

    #[test]
    fn blocks_of_code_values_round_trip_exactly() {
        // Every block holds code values times a power of two (exact in f32), its absmax the
        // same for all blocks, so the double quantisation restores it exactly: centred
        // absmax 0, scale 0, code 127, and `0 * 0 + offset = offset`.
        let scale = 0.125f32;
        let values: Vec<f32> = (0..BLOCK * 10)
            .map(|i| NF4_CODE[if i % BLOCK == 0 { 15 } else { (i * 7) % 16 }] * scale)
            .collect();
        let p = quantize(&values);
        assert_eq!(p.offset, scale);
        assert!(p.absmax_codes.iter().all(|&c| c == 127));
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let mut want = values.clone();
            dtype.round_slice(&mut want);
            assert_eq!(dequantized(&p, values.len(), dtype), want, "{dtype:?}");
        }
    }

    #[test]
    fn double_quantised_absmax_is_within_half_the_widest_gap_of_the_map() {
        // A spread of block scales (some near zero, some large) over several groups of 256.
        let n_blocks = 3 * ABSMAX_BLOCK + 17;
        let mut values = normal(n_blocks * BLOCK - 5, 11, 1.0);
        for (b, chunk) in values.chunks_mut(BLOCK).enumerate() {
            let s = 10f32.powf((b % 7) as f32 - 4.0);
            chunk.iter_mut().for_each(|v| *v *= s);
        }
        let p = quantize(&values);
        let map = dynamic_map();
        let widest = map.windows(2).map(|w| w[1] - w[0]).fold(0f32, f32::max);
        // The map ends at about -0.993 below and 1.0 above: -1 is as far from its nearest
        // entry as half the widest gap.
        assert!(1.0 + map[0] <= widest / 2.0 + 1e-6);
        let absmax = true_absmax(&values);
        let view = p.view();
        for (b, &a) in absmax.iter().enumerate() {
            let scale = p.absmax_scales[b / ABSMAX_BLOCK];
            let err = (view.block_absmax(b) - a).abs();
            let bound = scale * (widest / 2.0 + 1e-6) + p.offset.abs() * 2.0 * f32::EPSILON;
            assert!(
                err <= bound,
                "block {b}: restored {} vs {a} (bound {bound})",
                view.block_absmax(b)
            );
            // The search finds the nearest entry of the map.
            let x = (a - p.offset) * (1.0 / scale);
            let code = p.absmax_codes[b] as usize;
            let best = map
                .iter()
                .map(|&m| (m - x).abs())
                .fold(f32::INFINITY, f32::min);
            assert!(
                (map[code] - x).abs() <= best + 1e-7,
                "block {b}: code {code} for {x}"
            );
        }
        assert_eq!(p.absmax_scales.len(), 4);
    }

    #[test]
    fn the_dynamic_map_has_bitsandbytes_shape() {
        let m = dynamic_map();
        assert!(m.windows(2).all(|w| w[0] < w[1]), "ascending and distinct");
        assert_eq!((m[127], m[255]), (0.0, 1.0));
        for i in 0..127 {
            assert_eq!(m[i], -m[254 - i], "antisymmetric below 255");
        }
        // The smallest magnitude: 1e-6 times the midpoint of linspace(0.1, 1, 2).
        assert!((m[128] - 0.55e-6).abs() < 1e-12);
        // The largest below 1: the midpoint of linspace(0.1, 1, 65)'s last two values.
        assert!((m[254] - 0.992_968_75).abs() < 1e-6);
        // Entries are found by the search.
        for (i, &v) in m.iter().enumerate() {
            assert_eq!(dynamic_code(m, v) as usize, i);
        }
        assert_eq!(dynamic_code(m, -1.0), 0);
        assert_eq!(dynamic_code(m, 1.0), 255);
    }

    #[test]
    fn zero_blocks_decode_to_zero() {
        let mut values = normal(BLOCK * 5 + 3, 5, 1.0);
        values[BLOCK..2 * BLOCK].fill(0.0);
        values[5 * BLOCK..].fill(0.0);
        let p = quantize(&values);
        let out = dequantized(&p, values.len(), DType::F32);
        for i in (BLOCK..2 * BLOCK).chain(5 * BLOCK..values.len()) {
            assert_eq!(code_at(&p, i), 7);
            assert_eq!(out[i], 0.0, "value {i}");
        }
        // All-zero input: every absmax is 0, the offset too.
        let p = quantize(&[0.0; 100]);
        assert_eq!((p.offset, p.absmax_scales[0]), (0.0, 0.0));
        assert!(dequantized(&p, 100, DType::F32).iter().all(|&v| v == 0.0));
    }

    #[test]
    fn dequantised_types_round_the_f32_value() {
        let values = normal(1000, 9, 3.0);
        let p = quantize(&values);
        let f32s = dequantized(&p, values.len(), DType::F32);
        for dtype in [DType::BF16, DType::F16] {
            let got = dequantized(&p, values.len(), dtype);
            for (g, w) in got.iter().zip(&f32s) {
                assert_eq!(g.to_bits(), dtype.round(*w).to_bits());
            }
        }
        // The quantisation error of a normal weight: well under the widest code gap.
        let worst = values
            .iter()
            .zip(&f32s)
            .map(|(v, d)| (v - d).abs())
            .fold(0f32, f32::max);
        let amax = values.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert!(worst < 0.2 * amax, "worst error {worst} of absmax {amax}");
    }
}

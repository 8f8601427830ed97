//! Products of a few rows (a decode step's, up to [`FEW_ROWS_MAX`]) on tensor cores, reading
//! each weight value once: `y = x W^T` written or added into `y`, and the gate/up product fused
//! with the row's RMSNorm factor and SwiGLU. References: [`crate::engine::cpu::gemm`],
//! `cpu::rmsnorm::normed_rows` and [`crate::engine::cpu::swiglu`]. The launchers answer
//! `Ok(false)` for a call the kernels do not take (f32, an older GPU, more rows, widths off
//! their multiples, unaligned buffers), and the caller runs the general product instead.

use super::overlap::kernel_params;
use super::{
    CudaBackend, CudaError, Elem, ElemKernel, Program, Result, as_i32, check_len, raw_ptr,
};
use crate::engine::DType;
use cudarc::driver::{CudaSlice, LaunchConfig};

pub(super) const PROGRAM: Program = Program {
    name: "few_rows",
    source: concat!(
        include_str!("attention_tc.cu"),
        include_str!("few_rows.cu"),
        "\nFEW_ROWS_ENTRY_POINTS(TcBf16, bf16, 1)\nFEW_ROWS_ENTRY_POINTS(TcBf16, bf16, 2)\n",
        "FEW_ROWS_ENTRY_POINTS(TcF16, f16, 1)\nFEW_ROWS_ENTRY_POINTS(TcF16, f16, 2)\n",
        "FEW_ROWS_GROUPED_ENTRY_POINT(TcBf16, bf16)\nFEW_ROWS_GROUPED_ENTRY_POINT(TcF16, f16)\n",
        "FEW_ROWS_GROUPED6_ENTRY_POINT(TcBf16, bf16)\nFEW_ROWS_GROUPED6_ENTRY_POINT(TcF16, f16)\n",
        "FEW_ROWS_WIDE_ENTRY_POINTS(TcBf16, bf16, 1)\nFEW_ROWS_WIDE_ENTRY_POINTS(TcBf16, bf16, 2)\n",
        "FEW_ROWS_WIDE_ENTRY_POINTS(TcF16, f16, 1)\nFEW_ROWS_WIDE_ENTRY_POINTS(TcF16, f16, 2)\n",
        "FEW_ROWS_W12_ENTRY_POINT(TcBf16, bf16)\nFEW_ROWS_W12_ENTRY_POINT(TcF16, f16)\n",
    ),
    kernels: &[],
    elem_kernels: &[
        ElemKernel::FewRowsProductX1,
        ElemKernel::FewRowsProductX2,
        ElemKernel::FewRowsSwigluX1,
        ElemKernel::FewRowsSwigluX2,
        ElemKernel::FewRowsSwigluGrouped,
        ElemKernel::FewRowsSwigluGrouped6,
        ElemKernel::FewRowsProductX1W16,
        ElemKernel::FewRowsProductX2W16,
        ElemKernel::FewRowsSwigluX1W16,
        ElemKernel::FewRowsSwigluX2W16,
        ElemKernel::FewRowsProductX2W12,
    ],
    dtypes: &[DType::BF16, DType::F16],
};

/// The most rows the kernels take (a decode batch of 64).
pub const FEW_ROWS_MAX: usize = 64;
/// Output features a block owns, and the multiple the widths must be.
const FEATURES: usize = 16;
/// The k values a warp takes at a time, and the multiple `k` must be.
const CHUNK: usize = 32;
/// Calls of more than 16 rows take more blocks per feature tile, each reading the tile's
/// weight again, from L2 while the weight stays there. Measured at 64 rows on an H200: 5% faster
/// than cuBLAS end to end with SmolLM2-135M's weights (3.4 MiB at most), 38% slower with
/// Llama-3.2-1B's (8 to 64 MiB); so such calls take the kernels only for weights up to 4 MiB.
const GROUPED_WEIGHT_BYTES: usize = 4 << 20;

/// Whether a product of `rows` rows of `k` into `features` outputs has the kernels' shape
/// (16-bit operands on sm_80 or newer and aligned buffers aside, which the launchers check)
/// and runs faster there than in cuBLAS (see [`GROUPED_WEIGHT_BYTES`]) against a weight of
/// `weight_bytes`: the callers' choice, kept apart from what the launchers take, so that
/// every shape they take can be checked.
pub fn few_rows_pay(rows: usize, features: usize, k: usize, weight_bytes: usize) -> bool {
    let (_, groups) = row_tiles(rows);
    (1..=FEW_ROWS_MAX).contains(&rows)
        && features > 0
        && features.is_multiple_of(FEATURES)
        && k > 0
        && k.is_multiple_of(CHUNK)
        && (groups == 1 || weight_bytes <= GROUPED_WEIGHT_BYTES)
}

/// The kernels' row tiles of 8 a block (1 for up to 8 rows, else 2) and the blocks of each
/// feature tile for `rows` rows.
fn row_tiles(rows: usize) -> (usize, usize) {
    let xt = if rows <= 8 { 1 } else { 2 };
    (xt, rows.div_ceil(8 * xt))
}

impl CudaBackend {
    /// Whether a product of `rows` rows of `k` into `features` outputs in `T` fits the
    /// kernels' shapes on this GPU (the buffers' alignment is checked at launch). Whether the
    /// kernels pay for it is [`few_rows_pay`]'s question.
    fn few_rows_fit<T: Elem>(&self, rows: usize, features: usize, k: usize) -> bool {
        T::DTYPE != DType::F32 && self.info.arch() >= 80 && few_rows_pay(rows, features, k, 0)
    }

    /// The launch both forms share: `out[rows, features]` from `x[rows, k]` and the weight
    /// `w` of `weight_rows` rows, with the form's last argument. `kernels` are the form's
    /// 8-warp kernels (indexed by [`kernel_form`]) and its 16-warp ones for 8 and 16 rows a
    /// block, `twelve` its 12-warp one if it has one ([`block_warps`] chooses), `six` its
    /// 6-warp one ([`six_warps`] chooses). `Ok(false)`: not taken (see the module's
    /// note), nothing written.
    #[allow(clippy::too_many_arguments)]
    fn few_rows_launch<T: Elem, A: cudarc::driver::DeviceRepr>(
        &self,
        op: &'static str,
        kernels: [ElemKernel; 5],
        (twelve, six): (Option<ElemKernel>, Option<ElemKernel>),
        out: &mut CudaSlice<T>,
        x: &CudaSlice<T>,
        w: &CudaSlice<T>,
        (rows, features, k, weight_rows): (usize, usize, usize, usize),
        last: A,
    ) -> Result<bool> {
        let aligned = [&*out, x, w]
            .iter()
            .all(|b| raw_ptr(b, &self.stream) % 16 == 0);
        if !self.few_rows_fit::<T>(rows, features, k) || !aligned {
            return Ok(false);
        }
        check_len(op, "out", out, rows * features)?;
        check_len(op, "x", x, rows * k)?;
        check_len(op, "w", w, weight_rows * k)?;
        let (xt, groups) = row_tiles(rows);
        let form = kernel_form(rows, features, self.info.sm_count as usize);
        // The fused form's weight tiles: gate and up.
        let wt = if weight_rows == features { 1 } else { 2 };
        let grid = blocks(op, features, groups)?;
        let sms = self.info.sm_count as usize;
        let warps = block_warps(k, (xt, wt), grid as usize, sms, twelve.is_some());
        // 6-warp blocks where 8 warps would go round twice and 16 do not fit the grid.
        let (kernel, warps) = match (warps, twelve, six) {
            (Warps::Sixteen, _, _) => (kernels[3 + xt - 1], warps),
            (Warps::Twelve, Some(twelve), _) => (twelve, warps),
            (_, _, Some(six)) if six_warps(k, (xt, wt)) => (six, Warps::Six),
            _ => (kernels[form], Warps::Eight),
        };
        let func = self.elem_function::<T>(kernel)?;
        let (m32, n32, k32) = (
            as_i32(op, "rows", rows)?,
            as_i32(op, "features", features)?,
            as_i32(op, "k", k)?,
        );
        let [yp, xp, wp] = [&*out, x, w].map(|b| raw_ptr(b, &self.stream));
        // The kernels fetch their first weights early only when they may start early.
        let prefetch = i32::from(self.overlapping());
        let mut params = kernel_params![yp, xp, wp, m32, n32, k32, last, prefetch];
        let cfg = LaunchConfig {
            grid_dim: (grid, 1, 1),
            block_dim: (32 * warps.count(), 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the kernels' parameters in order; lengths checked above (the weight holds
        // `weight_rows` rows of k); every buffer starts on 16 bytes and k is a multiple of 32,
        // so each 16-byte load lies inside its row; each block writes its 16 features of its
        // own rows, below `rows` only; `out` is distinct from x and w (a &mut); the kernels
        // wait for the previous kernel before their first load (few_rows.cu).
        unsafe { self.launch_overlapped(func, cfg, &mut params) }?;
        Ok(true)
    }

    /// `y[rows, n] = x[rows, k] w[n, k]^T`, or `+=` with `accumulate` (f32 sums, one
    /// rounding). `Ok(false)`: not taken (see the module's note), nothing written.
    #[allow(clippy::too_many_arguments)]
    pub fn few_rows_product<T: Elem>(
        &self,
        y: &mut CudaSlice<T>,
        x: &CudaSlice<T>,
        w: &CudaSlice<T>,
        rows: usize,
        n: usize,
        k: usize,
        accumulate: bool,
    ) -> Result<bool> {
        use ElemKernel::{
            FewRowsProductX1, FewRowsProductX1W16, FewRowsProductX2, FewRowsProductX2W16,
        };
        let kernels = [
            FewRowsProductX1,
            FewRowsProductX2,
            FewRowsProductX2,
            FewRowsProductX1W16,
            FewRowsProductX2W16,
        ];
        let shape = (rows, n, k, n);
        // 2: the kernels of one row tile (up to 8 rows) load the accumulate input before their
        // loop (few_rows.cu).
        let acc = match (accumulate, row_tiles(rows).0 == 1 && early_accumulate()) {
            (false, _) => 0,
            (true, false) => 1,
            (true, true) => 2,
        };
        let extra = (Some(ElemKernel::FewRowsProductX2W12), None);
        self.few_rows_launch("few_rows_product", kernels, extra, y, x, w, shape, acc)
    }

    /// `h[rows, f] = silu(r gate) * (r up)`, `[gate | up] = x[rows, k] w[2f, k]^T`, `r` the
    /// RMSNorm factor `1 / sqrt(mean(x_row^2) + eps)` of each row of `x` itself (the gain is
    /// folded into `w`): the decode step's gate/up product, norm and SwiGLU in one kernel.
    /// `Ok(false)`: not taken, nothing written.
    #[allow(clippy::too_many_arguments)]
    pub fn few_rows_swiglu<T: Elem>(
        &self,
        h: &mut CudaSlice<T>,
        x: &CudaSlice<T>,
        w: &CudaSlice<T>,
        rows: usize,
        f: usize,
        k: usize,
        eps: f32,
    ) -> Result<bool> {
        use ElemKernel::{
            FewRowsSwigluGrouped, FewRowsSwigluX1, FewRowsSwigluX1W16, FewRowsSwigluX2,
            FewRowsSwigluX2W16,
        };
        let kernels = [
            FewRowsSwigluX1,
            FewRowsSwigluX2,
            FewRowsSwigluGrouped,
            FewRowsSwigluX1W16,
            FewRowsSwigluX2W16,
        ];
        self.few_rows_launch(
            "few_rows_swiglu",
            kernels,
            (None, Some(ElemKernel::FewRowsSwigluGrouped6)),
            h,
            x,
            w,
            (rows, f, k, 2 * f),
            eps,
        )
    }
}

/// Which of a form's three kernels takes `rows` rows into `features` outputs on `sms` SMs:
/// blocks of 8 rows (0), of 16 (1), or of 16 bounded to three blocks an SM (2: a fused gate/up
/// call of several blocks a feature tile that two blocks an SM would run in two waves).
/// Measured on an H200 (SmolLM2-135M's gate/up, 1536 features): 64 rows, 384 blocks, the
/// bounded kernel made decode 6% faster; 32 rows, 192 blocks, 1% slower.
fn kernel_form(rows: usize, features: usize, sms: usize) -> usize {
    match row_tiles(rows) {
        (1, _) => 0,
        (_, groups) if groups > 1 && features / FEATURES * groups > 2 * sms => 2,
        _ => 1,
    }
}

/// Whether `warps` warps a block take more than one round of loads over `k` (few_rows.cu's
/// `FewRowsShape::unroll` chunks a warp a round, from `2 wt + xt` loads a chunk).
fn over_one_round(k: usize, (xt, wt): (usize, usize), warps: usize) -> bool {
    let unroll = (16 / (2 * wt + xt)).clamp(1, 4);
    k / CHUNK > warps * unroll
}

/// The warps of a call's blocks (few_rows.cu's `FewRowsShape::warps`).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Warps {
    /// The form's kernel (`kernel_form`).
    Eight,
    /// `_w16`: one block an SM (their registers allow no more).
    Sixteen,
    /// `_x2_w12`, products of 16-row blocks: two blocks an SM.
    Twelve,
    /// `_grouped6`, gate/up blocks of 16 rows taking 3 chunks a warp a round, three an SM.
    Six,
}

impl Warps {
    fn count(self) -> u32 {
        match self {
            Warps::Eight => 8,
            Warps::Sixteen => 16,
            Warps::Twelve => 12,
            Warps::Six => 6,
        }
    }
}

/// Whether a gate/up call of 16-row blocks over `k` that 16-warp blocks do not take (its grid
/// exceeds an SM each) takes 6-warp blocks of 3 chunks a warp a round (`_grouped6`, three blocks
/// an SM) instead of 8 warps of 2: where 8 warps go round twice and 6 take k in one (17 or 18
/// chunks: SmolLM2-135M's k of 576 at batches 17 to 64), so that no warp's second round holds up
/// the block's reduction. Measured on an H200 (`docs/benchmarks/2026-11-30-h200/
/// gate-up-six-warps/`): SmolLM2-135M decode +1.0% at batch 24, +1.7% at 32, +2.1% at 48 and
/// +0.2-0.8% at 64, the same bits.
/// `KILN_GATE_UP_SIX_WARPS=0` keeps 8 warps (for comparing the two in one build).
fn six_warps(k: usize, tiles: (usize, usize)) -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let on = *ON.get_or_init(|| std::env::var("KILN_GATE_UP_SIX_WARPS").map_or(true, |v| v != "0"));
    on && tiles == (2, 2) && over_one_round(k, tiles, 8) && k / CHUNK <= 6 * 3
}

/// Which blocks take a call of `k` with `grid` blocks of `xt` row tiles and `wt` weight tiles on
/// `sms` SMs, `twelve` where the form has 12-warp blocks. Where 8 warps would go round their
/// loads more than once, more warps halve the rounds and double the bytes in flight an SM, but
/// only where the grid then still runs in one wave: 16 warps where it fits one block an SM,
/// else 12 where it fits two and 12 warps take one round. Measured on an H200
/// (`docs/benchmarks/2026-11-29-h200/wide-blocks/`, `twelve-warp-down/`): decode 3-5% faster at
/// batches 1-32 with 16-warp blocks (SmolLM2-135M's down product, Llama-3.2-1B's products), 2%
/// at SmolLM2's batch 64 with 12 (its down product, 144 blocks).
fn block_warps(k: usize, tiles: (usize, usize), grid: usize, sms: usize, twelve: bool) -> Warps {
    if !over_one_round(k, tiles, 8) {
        Warps::Eight
    } else if grid <= sms {
        Warps::Sixteen
    } else if twelve && tiles == (2, 1) && !over_one_round(k, tiles, 12) && grid <= 2 * sms {
        Warps::Twelve
    } else {
        Warps::Eight
    }
}

/// Whether products of up to 8 rows that add into their output load its old values before
/// their loop rather than after their reduction (`KILN_FEW_ROWS_EARLY_ACCUMULATE=0` keeps the
/// late load, for comparing the two in one build). Measured on an H200
/// (`docs/benchmarks/2026-11-29-h200/few-rows-early-accumulate/`): SmolLM2-135M decode +1.9%
/// at batch 1 and +1.8% at 8; compiled into the kernels of two row tiles as well, batch 64 was
/// 1.7% slower, so those keep the late load.
fn early_accumulate() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("KILN_FEW_ROWS_EARLY_ACCUMULATE").map_or(true, |v| v != "0"))
}

/// `groups` blocks (of rows) per 16 output features.
fn blocks(op: &'static str, features: usize, groups: usize) -> Result<u32> {
    u32::try_from(features / FEATURES * groups).map_err(|_| CudaError::Shape {
        op,
        detail: format!("{features} output features in {groups} groups of rows"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Row tiles a block and blocks a feature tile, by rows.
    #[test]
    fn row_tiles_split_rows_into_blocks_of_8_or_16() {
        assert_eq!(row_tiles(1), (1, 1));
        assert_eq!(row_tiles(8), (1, 1));
        assert_eq!(row_tiles(9), (2, 1));
        assert_eq!(row_tiles(17), (2, 2));
        assert_eq!(row_tiles(64), (2, 4));
    }

    /// Calls of up to 8 rows and of 9 to 16 take their own kernels; the bounded one takes
    /// calls of several blocks a tile only where two blocks an SM would take two waves.
    #[test]
    fn kernel_forms_follow_the_row_blocks_and_the_waves() {
        let smollm2_gate_up = |rows| kernel_form(rows, 1536, 132);
        let forms = [1, 8, 9, 16, 17, 32, 33, 64].map(smollm2_gate_up);
        assert_eq!(forms, [0, 0, 1, 1, 1, 1, 2, 2]);
        // One block a tile stays unbounded however many blocks (Llama-3.2-1B's 8192 features).
        assert_eq!(kernel_form(16, 8192, 132), 1);
    }

    /// More warps take the calls whose k needs more than one round of an 8-warp block's loads
    /// (SmolLM2-135M's down product, k 1536; Llama-3.2-1B's products, k 2048 and 8192; not
    /// SmolLM2's k of 576 except in the fused gate/up form of 16-row blocks, 2 chunks a round a
    /// warp there), 16 where the grid fits one block an SM, else 12 where it fits two.
    #[test]
    fn more_warps_take_the_calls_of_more_than_one_round() {
        let sms = 132;
        // SmolLM2-135M at batch 64: QKV (k 576, 240 blocks) and gate/up (grouped, 384) stay;
        // the down product (k 1536, 144 blocks) takes 12 warps; at batch 16 (36 blocks), 16.
        assert_eq!(block_warps(576, (2, 1), 240, sms, true), Warps::Eight);
        assert_eq!(block_warps(576, (2, 2), 384, sms, false), Warps::Eight);
        assert_eq!(block_warps(1536, (2, 1), 144, sms, true), Warps::Twelve);
        assert_eq!(block_warps(1536, (2, 1), 36, sms, true), Warps::Sixteen);
        assert_eq!(block_warps(576, (2, 2), 96, sms, false), Warps::Sixteen);
        // Llama-3.2-1B at batch 1: the down product (k 8192, 128 blocks) and o (k 2048) take
        // 16; QKV (192 blocks) and gate/up (512) stay at 8 (12 would go round twice at k 2048).
        assert_eq!(block_warps(8192, (1, 1), 128, sms, true), Warps::Sixteen);
        assert_eq!(block_warps(2048, (1, 1), 192, sms, true), Warps::Eight);
        assert_eq!(block_warps(2048, (2, 1), 192, sms, true), Warps::Eight);
        assert_eq!(block_warps(2048, (1, 2), 512, sms, false), Warps::Eight);
        // One round at 8 warps: never more.
        assert_eq!(block_warps(1024, (2, 1), 64, sms, true), Warps::Eight);
        assert_eq!(block_warps(576, (1, 2), 96, sms, false), Warps::Eight);
    }

    /// Gate/up calls of 16-row blocks take 6-warp blocks only where 8 warps would go round
    /// twice and 6 take k in one round (17 or 18 chunks of 32).
    #[test]
    fn six_warps_take_the_gate_up_calls_of_17_or_18_chunks() {
        assert!(six_warps(576, (2, 2)));
        assert!(six_warps(544, (2, 2)));
        assert!(!six_warps(512, (2, 2)));
        assert!(!six_warps(608, (2, 2)));
        assert!(!six_warps(576, (2, 1)));
    }

    /// Up to 16 rows always pay; more only against weights that stay in L2.
    #[test]
    fn many_rows_pay_only_against_small_weights() {
        assert!(few_rows_pay(16, 2048, 8192, 32 << 20));
        assert!(few_rows_pay(64, 3072, 576, 3 << 20));
        assert!(!few_rows_pay(17, 2048, 2048, 8 << 20));
        assert!(!few_rows_pay(65, 16, 32, 1 << 10));
        // Shapes off the kernels' multiples.
        assert!(!few_rows_pay(1, 24, 64, 0));
        assert!(!few_rows_pay(1, 16, 48, 0));
    }
}

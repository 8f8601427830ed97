//! Typed handles of the kernels the launchers call, one table for every program.
//!
//! A launcher names its kernel by a variant ([`Kernel`] for the kernels with one instance,
//! [`ElemKernel`] for those instantiated per activation type, whose instance the launcher's
//! type parameter picks), so a misspelt kernel does not compile, and the backend finds the
//! loaded function by index with no name to format or hash per launch. The table is one
//! enum for all programs rather than one per operation so that the backend keeps one flat
//! array of functions. Each program lists the handles it defines; a test compiles every
//! program and checks that each handle is an entry point of the program that lists it.

use crate::engine::DType;

/// The element types the [`ElemKernel`]s come in, in the order of their instances.
pub(super) const ELEM_DTYPES: &[DType] = &[DType::F32, DType::BF16, DType::F16];

/// Position of `dtype` in [`ELEM_DTYPES`].
pub(super) const fn elem_index(dtype: DType) -> usize {
    match dtype {
        DType::F32 => 0,
        DType::BF16 => 1,
        DType::F16 => 2,
    }
}

/// Declares both enums: a plain kernel's name is its CUDA name; an element-type kernel's name
/// is `{prefix}_{suffix}{postfix}` with the type's suffix (`f32`, `bf16`, `f16`), for every
/// element type unless `in [..]` names fewer.
macro_rules! kernel_table {
    (
        plain { $($p:ident = $pname:literal,)* }
        per_elem { $($e:ident = $prefix:literal $(+ $postfix:literal)? $(in [$($d:ident),+])?,)* }
    ) => {
        /// A kernel with one instance.
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub(super) enum Kernel { $($p,)* }

        impl Kernel {
            #[cfg(test)]
            pub(super) const ALL: &[Kernel] = &[$(Kernel::$p,)*];
            pub(super) const COUNT: usize = [$(Kernel::$p,)*].len();

            /// Its name in the CUDA source.
            pub(super) const fn name(self) -> &'static str {
                match self { $(Kernel::$p => $pname,)* }
            }
        }

        /// A kernel instantiated per activation element type ([`super::Elem`]).
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub(super) enum ElemKernel { $($e,)* }

        impl ElemKernel {
            #[cfg(test)]
            pub(super) const ALL: &[ElemKernel] = &[$(ElemKernel::$e,)*];
            pub(super) const COUNT: usize = [$(ElemKernel::$e,)*].len();

            /// Its name without the element type, which names the operation in errors.
            pub(super) const fn op(self) -> &'static str {
                match self { $(ElemKernel::$e => $prefix,)* }
            }

            /// Its name in the CUDA source for `dtype`.
            pub(super) const fn name(self, dtype: DType) -> &'static str {
                match self {
                    $(ElemKernel::$e => [
                        concat!($prefix, "_f32" $(, $postfix)?),
                        concat!($prefix, "_bf16" $(, $postfix)?),
                        concat!($prefix, "_f16" $(, $postfix)?),
                    ][elem_index(dtype)],)*
                }
            }

            /// The element types it is instantiated for.
            pub(super) const fn dtypes(self) -> &'static [DType] {
                match self { $(ElemKernel::$e => kernel_table!(@dtypes $($($d),+)?),)* }
            }
        }
    };
    (@dtypes) => { ELEM_DTYPES };
    (@dtypes $($d:ident),+) => { &[$(DType::$d),+] };
}

kernel_table! {
    plain {
        AdamwManyMasterOnly = "adamw_many_master_only",
        AdamwScaleGrad = "adamw_scale_grad",
        AdamwFirstMoment = "adamw_first_moment",
        AdamwSecondMoment = "adamw_second_moment",
        AdamwApply = "adamw_apply",
        BkChunkMaps = "bk_chunk_maps",
        BkScanMaps = "bk_scan_maps",
        BkForward = "bk_forward",
        BkBackwardLocal = "bk_backward_local",
        BkScanAffine = "bk_scan_affine",
        BkBackwardFinal = "bk_backward_final",
        BkForwardFused = "bk_forward_fused",
        BkBackwardFused = "bk_backward_fused",
        BkForwardLong16 = "bk_forward_long16",
        BkForwardLong32 = "bk_forward_long32",
        BkForwardLong64 = "bk_forward_long64",
        BkBackwardLong16 = "bk_backward_long16",
        BkBackwardLong32 = "bk_backward_long32",
        BkForwardWarp4 = "bk_forward_warp4",
        BkForwardWarp8 = "bk_forward_warp8",
        BkForwardWarp16 = "bk_forward_warp16",
        BkBackwardWarp4 = "bk_backward_warp4",
        BkBackwardWarp8 = "bk_backward_warp8",
        BkBackwardWarp16 = "bk_backward_warp16",
        NllLoss = "nll_loss",
        DiversityColumnSums = "diversity_column_sums",
        DiversityValue = "diversity_value",
        AccumulatePartials = "accumulate_partials",
        SumSquaresPartial = "sum_squares_partial",
        SumSquaresFinish = "sum_squares_finish",
        GatherSlotRows = "gather_slot_rows",
    }
    per_elem {
        AdamwManyCompute = "adamw_many_compute",
        AdamwRoundCompute = "adamw_round_compute",
        Add = "add",
        AddAssign = "add_assign",
        AddColsScaled = "add_cols_scaled",
        ColsScaled = "cols_scaled",
        SetBlock = "set_block",
        AttentionForwardHs16 = "attention_forward" + "_hs16",
        AttentionForwardHs32 = "attention_forward" + "_hs32",
        AttentionForwardHs64 = "attention_forward" + "_hs64",
        AttentionBackwardDqHs16 = "attention_backward_dq" + "_hs16",
        AttentionBackwardDqHs32 = "attention_backward_dq" + "_hs32",
        AttentionBackwardDqHs64 = "attention_backward_dq" + "_hs64",
        AttentionBackwardDkvHs16 = "attention_backward_dkv" + "_hs16",
        AttentionBackwardDkvHs32 = "attention_backward_dkv" + "_hs32",
        AttentionBackwardDkvHs64 = "attention_backward_dkv" + "_hs64",
        AttentionForwardHs64Tc = "attention_forward" + "_hs64_tc" in [BF16, F16],
        AttentionForwardHs128Tc = "attention_forward" + "_hs128_tc" in [BF16, F16],
        AttentionForwardHs96Tc = "attention_forward" + "_hs96_tc" in [BF16, F16],
        AttentionBackwardDqHs96Tc = "attention_backward_dq" + "_hs96_tc" in [BF16, F16],
        AttentionBackwardDkvHs96Tc = "attention_backward_dkv" + "_hs96_tc" in [BF16, F16],
        AttentionBackwardDqHs64Tc = "attention_backward_dq" + "_hs64_tc" in [BF16, F16],
        AttentionBackwardDqHs128Tc = "attention_backward_dq" + "_hs128_tc" in [BF16, F16],
        AttentionBackwardDkvHs64Tc = "attention_backward_dkv" + "_hs64_tc" in [BF16, F16],
        AttentionBackwardDkvHs128Tc = "attention_backward_dkv" + "_hs128_tc" in [BF16, F16],
        AttentionForwardHs64Wgmma = "attention_forward" + "_hs64_wgmma" in [BF16, F16],
        AttentionForwardHs128Wgmma = "attention_forward" + "_hs128_wgmma" in [BF16, F16],
        AttentionForwardHs64WgmmaTma = "attention_forward" + "_hs64_wgmma_tma" in [BF16, F16],
        AttentionForwardHs128WgmmaTma = "attention_forward" + "_hs128_wgmma_tma" in [BF16, F16],
        AttentionBackwardDqHs64Wgmma = "attention_backward_dq" + "_hs64_wgmma" in [BF16, F16],
        AttentionBackwardDqHs128Wgmma = "attention_backward_dq" + "_hs128_wgmma" in [BF16, F16],
        AttentionBackwardDkvHs64Wgmma = "attention_backward_dkv" + "_hs64_wgmma" in [BF16, F16],
        AttentionBackwardDkvHs128Wgmma = "attention_backward_dkv" + "_hs128_wgmma" in [BF16, F16],
        AttentionBackwardDqHs64WgmmaTma = "attention_backward_dq" + "_hs64_wgmma_tma" in [BF16, F16],
        AttentionBackwardDkvHs64WgmmaTma = "attention_backward_dkv" + "_hs64_wgmma_tma" in [BF16, F16],
        AttentionBackwardDqHs128WgmmaTma = "attention_backward_dq" + "_hs128_wgmma_tma" in [BF16, F16],
        AttentionBackwardDkvHs128WgmmaTma = "attention_backward_dkv" + "_hs128_wgmma_tma" in [BF16, F16],
        AttentionForwardHs128WgmmaPersist = "attention_forward" + "_hs128_wgmma_persist" in [BF16, F16],
        AttentionForwardHs64WgmmaPersist = "attention_forward" + "_hs64_wgmma_persist" in [BF16, F16],
        AttentionValueBoundHs64 = "attention_value_bound" + "_hs64" in [F16],
        AttentionValueBoundHs128 = "attention_value_bound" + "_hs128" in [F16],
        AttentionForwardHs64Tf32 = "attention_forward" + "_hs64_tf32" in [F32],
        AttentionForwardHs128Tf32 = "attention_forward" + "_hs128_tf32" in [F32],
        AttentionBackwardDqHs64Tf32 = "attention_backward_dq" + "_hs64_tf32" in [F32],
        AttentionBackwardDqHs128Tf32 = "attention_backward_dq" + "_hs128_tf32" in [F32],
        AttentionBackwardDkvHs64Tf32 = "attention_backward_dkv" + "_hs64_tf32" in [F32],
        AttentionBackwardDkvHs128Tf32 = "attention_backward_dkv" + "_hs128_tf32" in [F32],
        AttentionForwardHs64Tf32x3 = "attention_forward" + "_hs64_tf32x3" in [F32],
        AttentionForwardHs128Tf32x3 = "attention_forward" + "_hs128_tf32x3" in [F32],
        AttentionBackwardDqHs64Tf32x3 = "attention_backward_dq" + "_hs64_tf32x3" in [F32],
        AttentionBackwardDqHs128Tf32x3 = "attention_backward_dq" + "_hs128_tf32x3" in [F32],
        AttentionBackwardDkvHs64Tf32x3 = "attention_backward_dkv" + "_hs64_tf32x3" in [F32],
        AttentionBackwardDkvHs128Tf32x3 = "attention_backward_dkv" + "_hs128_tf32x3" in [F32],
        MaskedAttentionForwardHs16 = "masked_attention_forward" + "_hs16",
        MaskedAttentionForwardHs32 = "masked_attention_forward" + "_hs32",
        MaskedAttentionForwardHs64 = "masked_attention_forward" + "_hs64",
        PaddedSoftmax = "padded_softmax",
        SoftmaxBackwardRows = "softmax_backward_rows",
        HeadsFromRows = "heads_from_rows",
        HeadsToRows = "heads_to_rows",
        CausalSoftmax = "causal_softmax",
        CausalSoftmaxBackward = "causal_softmax_backward",
        CrossEntropyForward = "cross_entropy_forward",
        CrossEntropyFused = "cross_entropy_fused",
        CrossEntropyFusedStaged = "cross_entropy_fused_staged",
        CrossEntropyFusedC2 = "cross_entropy_fused_c2",
        CrossEntropyFusedC4 = "cross_entropy_fused_c4",
        CrossEntropyFusedC8 = "cross_entropy_fused_c8",
        LogSoftmax = "log_softmax",
        LogSoftmaxNllBackward = "log_softmax_nll_backward",
        DiversityPartial = "diversity_partial",
        DiversityBackward = "diversity_backward",
        Dropout = "dropout",
        FewRowsProductX1 = "few_rows_product" + "_x1" in [BF16, F16],
        FewRowsProductX2 = "few_rows_product" + "_x2" in [BF16, F16],
        FewRowsSwigluX1 = "few_rows_swiglu" + "_x1" in [BF16, F16],
        FewRowsSwigluX2 = "few_rows_swiglu" + "_x2" in [BF16, F16],
        FewRowsSwigluGrouped = "few_rows_swiglu" + "_grouped" in [BF16, F16],
        FewRowsSwigluGrouped6 = "few_rows_swiglu" + "_grouped6" in [BF16, F16],
        FewRowsProductX1W16 = "few_rows_product" + "_x1_w16" in [BF16, F16],
        FewRowsProductX2W16 = "few_rows_product" + "_x2_w16" in [BF16, F16],
        FewRowsSwigluX1W16 = "few_rows_swiglu" + "_x1_w16" in [BF16, F16],
        FewRowsSwigluX2W16 = "few_rows_swiglu" + "_x2_w16" in [BF16, F16],
        FewRowsProductX2W12 = "few_rows_product" + "_x2_w12" in [BF16, F16],
        EmbeddingForward = "embedding_forward",
        EmbeddingBackwardRows = "embedding_backward_rows",
        EmbeddingBackwardWpe = "embedding_backward_wpe",
        GeluForward = "gelu_forward",
        GeluBackward = "gelu_backward",
        GeluErfForward = "gelu_erf_forward",
        GeluErfBackward = "gelu_erf_backward",
        KvAppend = "kv_append",
        KvAppendNormed = "kv_append_normed",
        KvAppendRows = "kv_append_rows",
        KvAppendNormedRows = "kv_append_normed_rows",
        CopyCacheSlot = "copy_cache_slot",
        PrefillPack = "prefill_pack",
        CacheAttentionCombine = "cache_attention_combine",
        CacheAttentionL8G2 = "cache_attention" + "_l8_g2",
        CacheAttentionL8G4 = "cache_attention" + "_l8_g4",
        CacheAttentionL8G8 = "cache_attention" + "_l8_g8",
        CacheAttentionL16G2 = "cache_attention" + "_l16_g2",
        CacheAttentionL16G4 = "cache_attention" + "_l16_g4",
        CacheAttentionL16G8 = "cache_attention" + "_l16_g8",
        CacheAttentionL32G2 = "cache_attention" + "_l32_g2",
        CacheAttentionL32G4 = "cache_attention" + "_l32_g4",
        CacheAttentionL32G8 = "cache_attention" + "_l32_g8",
        CacheAttentionWideL8G2 = "cache_attention_wide" + "_l8_g2",
        CacheAttentionWideL8G3 = "cache_attention_wide" + "_l8_g3",
        CacheAttentionWideL8G4 = "cache_attention_wide" + "_l8_g4",
        CacheAttentionWideL8G8 = "cache_attention_wide" + "_l8_g8",
        CacheAttentionWideL16G2 = "cache_attention_wide" + "_l16_g2",
        CacheAttentionWideL16G4 = "cache_attention_wide" + "_l16_g4",
        CacheAttentionWideL16G8 = "cache_attention_wide" + "_l16_g8",
        CacheAttentionAppendL8G2 = "cache_attention_append" + "_l8_g2",
        CacheAttentionAppendL8G3 = "cache_attention_append" + "_l8_g3",
        CacheAttentionAppendL8G4 = "cache_attention_append" + "_l8_g4",
        CacheAttentionAppendL8G8 = "cache_attention_append" + "_l8_g8",
        CacheAttentionAppendL16G2 = "cache_attention_append" + "_l16_g2",
        CacheAttentionAppendL16G4 = "cache_attention_append" + "_l16_g4",
        CacheAttentionAppendL16G8 = "cache_attention_append" + "_l16_g8",
        CacheAttentionAppendD64G2 = "cache_attention_append" + "_d64_g2",
        CacheAttentionAppendD64G3 = "cache_attention_append" + "_d64_g3",
        CacheAttentionAppendD64G4 = "cache_attention_append" + "_d64_g4",
        CacheAttentionAppendD64G8 = "cache_attention_append" + "_d64_g8",
        CacheAttentionAppendD128G2 = "cache_attention_append" + "_d128_g2",
        CacheAttentionAppendD128G4 = "cache_attention_append" + "_d128_g4",
        CacheAttentionAppendD128G8 = "cache_attention_append" + "_d128_g8",
        LayernormForward = "layernorm_forward",
        ResidualLayernormForward = "residual_layernorm_forward",
        LayernormBackwardInput = "layernorm_backward_input",
        LayernormParamGradPartial = "layernorm_param_grad_partial",
        LayernormBackwardFused = "layernorm_backward_fused",
        Nf4Dequantize = "nf4_dequantize",
        ColumnSumPartial = "column_sum_partial",
        RmsnormForward = "rmsnorm_forward",
        ResidualRmsnormForward = "residual_rmsnorm_forward",
        RmsnormBackwardInput = "rmsnorm_backward_input",
        RmsnormParamGradPartial = "rmsnorm_param_grad_partial",
        RmsnormBackwardFused = "rmsnorm_backward_fused",
        RopeExpandForward = "rope_expand_forward",
        RopeExpandBackward = "rope_expand_backward",
        RopePairsForward = "rope_pairs_forward",
        RopePairsBackward = "rope_pairs_backward",
        GatherRows = "gather_rows",
        ScatterAddRows = "scatter_add_rows",
        GatheredRowDot = "gathered_row_dot",
        SampleMax = "sample_max",
        SampleHistogram = "sample_histogram",
        SampleSelect = "sample_select",
        SampleDraw = "sample_draw",
        SwigluForward = "swiglu_forward",
        SwigluForwardNormed = "swiglu_forward_normed",
        SwigluBackward = "swiglu_backward",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_put_the_type_suffix_where_the_sources_do() {
        assert_eq!(
            ElemKernel::SwigluForward.name(DType::BF16),
            "swiglu_forward_bf16"
        );
        assert_eq!(
            ElemKernel::AttentionBackwardDkvHs128Tc.name(DType::F16),
            "attention_backward_dkv_f16_hs128_tc"
        );
        assert_eq!(
            ElemKernel::CacheAttentionL16G4.name(DType::F32),
            "cache_attention_f32_l16_g4"
        );
        assert_eq!(Kernel::NllLoss.name(), "nll_loss");
        for (i, &d) in ELEM_DTYPES.iter().enumerate() {
            assert_eq!(elem_index(d), i);
        }
    }
}

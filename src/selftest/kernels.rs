//! The `kernels` group: every kernel check, in the order the table prints them, with its shapes and
//! bounds; the checks themselves live in the sibling modules by kind of kernel.

use super::*;

pub(super) fn run_checks(gpu: &CudaBackend, inp: &mut Inputs, only: &KernelFilter) -> Vec<Row> {
    let mut rows = Vec::new();
    let wants = |kernel: &str| only.wants(kernel);
    let mut push = |kernel: &str, dtype: &'static str, shape: String, bound: f64, result| {
        if !wants(kernel) {
            return;
        }
        rows.push(Row {
            kernel: kernel.to_string(),
            dtype,
            shape,
            result,
            bound,
        })
    };
    macro_rules! both_dtypes {
        ($f:ident, $name:expr, $shape:expr, $($arg:expr),*) => {
            if wants($name) {
                push($name, "f32", $shape.clone(), bound_of($name, BOUND_FP32), $f::<f32>(gpu, inp, $($arg),*));
                push($name, "bf16", $shape.clone(), bound_of($name, BOUND_BF16), $f::<Bf16>(gpu, inp, $($arg),*));
                push($name, "f16", $shape.clone(), bound_of($name, BOUND_F16), $f::<F16>(gpu, inp, $($arg),*));
            }
        };
    }
    for (n, c) in [(1024, 768), (70, 768), (37, 1001)] {
        let shape = format!("{n}x{c}");
        both_dtypes!(check_layernorm_forward, "layernorm_forward", shape, n, c);
        both_dtypes!(
            check_residual_layernorm,
            "residual_layernorm_forward",
            shape,
            n,
            c
        );
        both_dtypes!(check_layernorm_backward, "layernorm_backward", shape, n, c);
    }
    for n in [(1 << 20) + 3, 1000] {
        both_dtypes!(check_dropout, "dropout", &format!("{n} p 0.1"), n);
        both_dtypes!(check_gelu_forward, "gelu_forward", &format!("{n}"), n);
        both_dtypes!(check_gelu_backward, "gelu_backward", &format!("{n}"), n);
    }
    // 50304 f32 fits a Hopper block's shared memory (the staged kernel), 65536 f32 and
    // Llama-3's 128256 do not. GPT-2's 50257 tokens padded to 50304 columns checks the
    // masking of the padding. On Hopper the rows of whole 16-byte pieces split over clusters
    // of 2, 4 or 8 blocks; 50264 leaves the cluster's last block a shorter share, Qwen's
    // 151936 takes 8 blocks in bf16, and 1001 runs the single-block kernels.
    for (n, v, valid) in [
        (64, 50304, 50257),
        (4, 65536, 65536),
        (3, 128256, 128256),
        (6, 50264, 50000),
        (5, 151936, 151669),
        (7, 1001, 1001),
    ] {
        let shape = format!("{n}x{v} valid {valid}");
        both_dtypes!(
            check_cross_entropy_forward,
            "cross_entropy_forward",
            shape,
            n,
            v,
            valid
        );
        both_dtypes!(
            check_cross_entropy_fused,
            "cross_entropy_fused",
            shape,
            n,
            v,
            valid
        );
        both_dtypes!(
            check_cross_entropy_unfused,
            "cross_entropy_unfused",
            shape,
            n,
            v,
            valid
        );
    }
    // The residual add of the unfused path: a GPT-2-wide stream and a ragged length (the
    // one-at-a-time tail).
    for n in [8192 * 768, 1001] {
        both_dtypes!(check_add, "add, add_assign", &format!("{n}"), n);
    }
    // Stacking three rank-16 adapters' A (Llama-3.2-1B width) and adding one's rows of the
    // stacked gradient back (or copying them, on a step's first write), and ragged sizes.
    for (n, at) in [(16 * 2048, 16 * 2048), (37, 11)] {
        let shape = format!("n{n} at{at}");
        both_dtypes!(
            check_offsets,
            "copy_into_at, add_assign_from, copy_from_at",
            shape,
            n,
            at
        );
    }
    // A rank-16 adapter's columns of a fused QKV projection (SmolLM2 shape), and ragged sizes.
    for (n, row, col0, c) in [(16384, 960, 576, 192), (37, 101, 13, 29)] {
        let shape = format!("N{n} row{row} cols{col0}+{c}");
        both_dtypes!(
            check_cols,
            "add_cols_scaled, cols_scaled, set_block",
            shape,
            n,
            row,
            col0,
            c
        );
    }
    for (vocab, seq, n, c) in [(50304, 256, 1024, 768), (97, 5, 23, 33)] {
        let shape = format!("V{vocab} T{seq} N{n} C{c}");
        both_dtypes!(
            check_embedding_forward,
            "embedding_forward",
            shape,
            vocab,
            seq,
            n,
            c
        );
        both_dtypes!(
            check_embedding_backward,
            "embedding_backward",
            shape,
            vocab,
            seq,
            n,
            c
        );
    }
    // Llama-family operations. RMSNorm at SmolLM2's and Llama-3.2-1B's widths (rows held in
    // registers; the fused backward's chunks of 16 rows then end ragged at 70 rows), a ragged one
    // (not a multiple of the block, an odd row count) and one too wide to hold (both read
    // twice).
    for (n, c, eps) in [
        (1024, 576, 1e-5),
        (70, 576, 1e-5),
        (512, 2048, 1e-5),
        (37, 1001, 1e-6),
        (9, 8192, 1e-5),
    ] {
        let shape = format!("{n}x{c}");
        both_dtypes!(check_rmsnorm_forward, "rmsnorm_forward", shape, n, c, eps);
        both_dtypes!(
            check_residual_rmsnorm,
            "residual_rmsnorm_forward",
            shape,
            n,
            c,
            eps
        );
        both_dtypes!(check_rmsnorm_backward, "rmsnorm_backward", shape, n, c);
    }
    // Rotary embeddings with grouped-query heads: SmolLM2 (9 heads over 3), Llama-3.2-1B (32
    // over 8, Llama 3 frequency scaling), Qwen3-0.6B (head 128), partial rotary (32 of 64),
    // multi-query (one key/value head) and plain multi-head, ragged row counts.
    let llama3 = cpu::rope::Llama3Scaling {
        factor: 32.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_context: 8192,
    };
    for (rows, heads, kv_heads, head_dim, rot_dim, theta, scaling) in [
        (1024, 9, 3, 64, 64, 100_000.0, None),
        (512, 32, 8, 64, 64, 500_000.0, Some(llama3)),
        (256, 16, 8, 128, 128, 1_000_000.0, None),
        (37, 4, 2, 64, 32, 10_000.0, None),
        (19, 8, 1, 16, 16, 10_000.0, None),
        (23, 3, 3, 32, 24, 10_000.0, None),
        // A head size that is no multiple of 4: one dimension a thread.
        (17, 6, 2, 18, 10, 10_000.0, None),
    ] {
        let s = cpu::rope::RopeShape {
            rows,
            heads,
            kv_heads,
            head_dim,
            rot_dim,
        };
        let shape = format!("R{rows} H{heads}/{kv_heads} D{head_dim} rot{rot_dim}");
        let (cos, sin) = cpu::rope::rope_tables(
            &cpu::rope::inverse_frequencies(theta, rot_dim, scaling),
            ROPE_POSITIONS,
        );
        let tables = (&cos[..], &sin[..]);
        both_dtypes!(check_rope_forward, "rope_expand_forward", shape, s, tables);
        both_dtypes!(
            check_rope_backward,
            "rope_expand_backward",
            shape,
            s,
            tables
        );
    }
    // The key/value cache of generation at SmolLM2's, Llama-3.2-1B's, a Qwen3-like, a
    // multi-query shape (two blocks of eight query heads per key/value head) and Qwen2.5-0.5B's
    // (seven query heads a key/value head: blocks of eight with one place unused): decode steps
    // of 64 sequences in distinct slots at positions up to 1500, of 4 long ones (rows split
    // over the cache length, some splits empty) and of 8 below 250 (unsplit), and a prefill of
    // 37 tokens into one slot. Cache positions no row covers hold NaN, so a stray read or write shows.
    // Then GPT-2 small's and the default GPT's (a theta of 0: no rotation, keys and values
    // appended as projected, a key/value head per head; head size 32 on the general kernels).
    for (heads, kv_heads, head_dim, theta) in [
        (9, 3, 64, 100_000.0),
        (32, 8, 64, 500_000.0),
        (16, 8, 128, 1_000_000.0),
        (16, 1, 64, 10_000.0),
        (14, 2, 64, 1_000_000.0),
        (12, 12, 64, 0.0),
        (4, 4, 32, 0.0),
    ] {
        let rot_dim = if theta > 0.0 { head_dim } else { 0 };
        // Without rotation no table is read; one entry stands in for it.
        let (cos, sin) = match rot_dim {
            0 => (vec![1.0], vec![0.0]),
            _ => cpu::rope::rope_tables(
                &cpu::rope::inverse_frequencies(theta, head_dim, None),
                KV_MAX_LEN,
            ),
        };
        let tables = (&cos[..], &sin[..]);
        // Rows of up to 250 positions are never split: a block of the appending kernel a
        // position a thread then takes two rounds of positions at head size 64, four at 128.
        for call in [
            KvCall::Decode(64, 1500),
            KvCall::Decode(4, 1500),
            KvCall::Decode(8, 250),
            KvCall::Prefill(37),
        ] {
            let (c, slot, pos) = call.rows(inp, kv_heads, head_dim);
            let s = cpu::rope::RopeShape {
                rows: slot.len(),
                heads,
                kv_heads,
                head_dim,
                rot_dim,
            };
            let longest = pos.iter().map(|&p| p as usize + 1).max().unwrap_or(0);
            let plan = |read: usize| {
                cuda::attention_plan(
                    s.rows,
                    heads,
                    kv_heads,
                    head_dim,
                    read,
                    gpu.info().sm_count as usize,
                )
            };
            let splits = |read: usize| plan(read).map_or(0, |p| p.splits);
            // Whether the one appending kernel runs (wide blocks, head sizes to 128), not the
            // append and attention kernels in turn.
            let fused = |read: usize| plan(read).is_some_and(|p| p.wide && p.lanes < 32);
            let base = format!("R{} H{heads}/{kv_heads} D{head_dim}", s.rows);
            let rows = (&slot[..], &pos[..]);
            both_dtypes!(check_kv_append, "kv_append", base, s, c, rows, tables, None);
            // The folded decode step's append: the projection of an unnormalised stream of
            // 576 (SmolLM2's width), each row scaled by its RMSNorm factor first, and with a
            // bias after it (Qwen2's).
            for bias in [false, true] {
                let shape = format!("{base}{}", if bias { " bias" } else { "" });
                both_dtypes!(
                    check_kv_append,
                    "kv_append_normed",
                    shape,
                    s,
                    c,
                    rows,
                    tables,
                    Some(bias)
                );
            }
            // Partial rotary dimensions at SmolLM2's shape: 32 of 64 takes the row kernels
            // (pieces of eight, dimensions past 32 passed through), 24 the element kernels
            // (its halves of 12 split a piece).
            if heads == 9 && matches!(call, KvCall::Prefill(_)) {
                for rot_dim in [32, 24] {
                    let (cos, sin) = cpu::rope::rope_tables(
                        &cpu::rope::inverse_frequencies(theta, rot_dim, None),
                        KV_MAX_LEN,
                    );
                    let s = cpu::rope::RopeShape { rot_dim, ..s };
                    let shape = format!("{base} rot{rot_dim}");
                    let tables = (&cos[..], &sin[..]);
                    both_dtypes!(
                        check_kv_append,
                        "kv_append",
                        shape,
                        s,
                        c,
                        rows,
                        tables,
                        None
                    );
                    both_dtypes!(
                        check_kv_append,
                        "kv_append_normed",
                        shape,
                        s,
                        c,
                        rows,
                        tables,
                        Some(true)
                    );
                }
            }
            // The decode step's append and attention in one kernel, with and without a bias
            // and a window, against the two CPU ops in turn (a prefill keeps two kernels).
            if let KvCall::Decode(..) = call {
                for (bias, window) in [(false, 0), (true, 0), (false, 700)] {
                    let read = if window > 0 {
                        longest.min(window)
                    } else {
                        longest
                    };
                    let shape = format!(
                        "{base}{}{} split{} {}",
                        if bias { " bias" } else { "" },
                        if window > 0 {
                            format!(" W{window}")
                        } else {
                            String::new()
                        },
                        splits(read),
                        if fused(read) { "fused" } else { "two kernels" }
                    );
                    both_dtypes!(
                        check_cache_attention_append,
                        "cache_attention_append",
                        shape,
                        s,
                        c,
                        rows,
                        tables,
                        (bias, window)
                    );
                }
            }
            let shape = format!("{base} split{}", splits(longest));
            both_dtypes!(
                check_cache_attention,
                "cache_attention",
                shape,
                heads,
                0,
                c,
                rows
            );
            // Within a sliding window: one shorter than the prefill, and one that still
            // leaves the long decode rows split.
            let window = match call {
                KvCall::Prefill(_) => 16,
                KvCall::Decode(..) => 700,
            };
            let shape = format!("{base} W{window} split{}", splits(longest.min(window)));
            both_dtypes!(
                check_cache_attention,
                "cache_attention_window",
                shape,
                heads,
                window,
                c,
                rows
            );
        }
        let c = cpu::kv_cache::CacheShape {
            slots: 4,
            kv_heads,
            max_len: 300,
            head_dim,
        };
        let shape = format!("K{kv_heads} D{head_dim} 257 of 300");
        both_dtypes!(check_copy_cache_slot, "copy_cache_slot", shape, c);
    }
    // SwiGLU at SmolLM2's and Llama-3.2-1B's FFN widths (four per access) and a ragged width
    // (one at a time).
    for (n, f) in [(1024, 1536), (128, 8192), (37, 1001)] {
        let shape = format!("{n}x2x{f}");
        both_dtypes!(check_swiglu_forward, "swiglu_forward", shape, n, f);
        both_dtypes!(
            check_swiglu_forward_normed,
            "swiglu_forward_normed",
            shape,
            n,
            f
        );
        both_dtypes!(check_swiglu_backward, "swiglu_backward", shape, n, f);
    }
    // The token table's backward alone (rotary models): SmolLM2's vocabulary and width, a
    // ragged shape, and rows wider than a block (two passes, the second with idle threads)
    // whose hot token has more positions than a block stages at once.
    for (vocab, n, c) in [(49152, 2048, 576), (97, 23, 33), (1000, 4096, 1536)] {
        let shape = format!("V{vocab} N{n} C{c}");
        both_dtypes!(
            check_token_embedding_backward,
            "token_embedding_backward",
            shape,
            vocab,
            n,
            c
        );
    }
    // The sampler at SmolLM2's and Llama 3's vocabularies and a ragged one, for greedy with
    // a penalty, nucleus, top-k with min-p and a penalty, and the full distribution; one
    // case per vocabulary maps rows to shared logits rows and permuted slots, as a prefill's
    // samples do. The error is the fraction of rows drawing another token than the CPU
    // (ties and rounding only) or the log-probability's relative error, whichever is worse;
    // a slot state (position, counter, presence) that differs is a failure.
    // Each row is split over many blocks, as many as fill the GPU for the call's row count:
    // 96 rows, the 64 rows of a decode batch, and 16 rows drawn one per call (batch 1, the
    // most blocks per row, and the scratch reused call after call).
    for (vocab, rows, per_call) in [
        (49152usize, 96usize, 96usize),
        (49152, 64, 64),
        (128256, 96, 96),
        (128256, 64, 64),
        (128256, 16, 1),
        (1001, 96, 96),
    ] {
        for (name, p, mapped, scale) in sample_cases() {
            let shape = format!("V{vocab} R{rows}/{per_call} {name}");
            both_dtypes!(
                check_sample_rows,
                "sample_rows",
                shape,
                vocab,
                (p, scale),
                mapped,
                rows,
                per_call
            );
        }
    }
    if wants("gather_slot_rows") {
        push(
            "gather_slot_rows",
            "u32",
            "37 rows of 50 slots".into(),
            0.0,
            check_gather_slot_rows(gpu, inp),
        );
    }
    // Mixture-of-experts routing: 1.5 slots per token over a GPT-2-wide stream, and a ragged
    // shape with a width that is not a multiple of the block.
    for (src_rows, rows, c) in [(8192, 12288, 768), (37, 29, 33)] {
        let shape = format!("{rows} of {src_rows}x{c}");
        both_dtypes!(check_gather_rows, "gather_rows", shape, src_rows, rows, c);
        both_dtypes!(
            check_scatter_add_rows,
            "scatter_add_rows",
            shape,
            src_rows,
            rows.min(src_rows),
            c
        );
        both_dtypes!(
            check_gathered_row_dot,
            "gathered_row_dot",
            shape,
            src_rows,
            rows,
            c
        );
    }
    for n in [1_000_003, 77] {
        for (kernels, name) in [
            (Kernels::Fused, "adamw_update"),
            (Kernels::Unfused, "adamw_update_unfused"),
        ] {
            if wants(name) {
                let master_only = check_adamw::<f32>(gpu, inp, n, false, kernels);
                push(
                    &format!("{name} (master only)"),
                    "f32",
                    format!("{n}"),
                    BOUND_FP32,
                    master_only,
                );
            }
            both_dtypes!(check_adamw, name, &format!("{n}"), n, true, kernels);
        }
    }
    // One launch over ragged tensors (tails of 1-3, a single piece, one past a piece), each
    // with its own weight decay, against the CPU update of each alone.
    let sizes = [77, 1_000_003, 16384, 16385, 1, 6];
    let shape = format!("{sizes:?}");
    if wants("adamw_update_many") {
        let r = check_adamw_many::<f32>(gpu, inp, &sizes, false);
        push(
            "adamw_update_many (master only)",
            "f32",
            shape.clone(),
            BOUND_FP32,
            r,
        );
    }
    both_dtypes!(check_adamw_many, "adamw_update_many", &shape, &sizes, true);
    for n in [10_000_019, 1000] {
        if wants("sum_squares") {
            let r = check_sum_squares(gpu, inp, n, None);
            push("sum_squares", "f32", format!("{n}"), BOUND_FP32, r);
        }
    }
    let sizes = [2_359_296, 0, 768, 1_000_003, 1];
    if wants("sum_squares_many") {
        let r = check_sum_squares_many(gpu, inp, &sizes);
        push(
            "sum_squares_many",
            "f32",
            format!("{sizes:?}"),
            BOUND_FP32,
            r,
        );
    }
    for (bad, name) in [
        (f32::NAN, "sum_squares (NaN flag)"),
        (f32::INFINITY, "sum_squares (inf flag)"),
    ] {
        if wants(name) {
            let r = check_sum_squares(gpu, inp, 100_003, Some(bad));
            push(name, "f32", "100003".into(), 0.0, r);
        }
    }
    if wants("linear_forward") || wants("linear_backward") || wants("matmul (A^T B^T)") {
        for (n, c_in, c_out) in [(512, 768, 2304), (37, 53, 29)] {
            let shape = format!("{n}x{c_in}->{c_out}");
            for (label, math, b) in [
                ("f32", GemmMath::Fp32, BOUND_FP32),
                ("tf32", GemmMath::Tf32, BOUND_TF32),
            ] {
                let r = check_linear_forward::<f32>(gpu, inp, n, c_in, c_out, math);
                push("linear_forward", label, shape.clone(), b, r);
                let r = check_linear_backward::<f32>(gpu, inp, n, c_in, c_out, math);
                push("linear_backward", label, shape.clone(), b, r);
            }
            let r = check_linear_forward::<Bf16>(gpu, inp, n, c_in, c_out, GemmMath::Fp32);
            push("linear_forward", "bf16", shape.clone(), BOUND_BF16, r);
            let r = check_linear_backward::<Bf16>(gpu, inp, n, c_in, c_out, GemmMath::Fp32);
            push("linear_backward", "bf16", shape.clone(), BOUND_BF16, r);
            let r = check_linear_forward::<F16>(gpu, inp, n, c_in, c_out, GemmMath::Fp32);
            push("linear_forward", "f16", shape.clone(), BOUND_F16, r);
            let r = check_linear_backward::<F16>(gpu, inp, n, c_in, c_out, GemmMath::Fp32);
            push("linear_backward", "f16", shape.clone(), BOUND_F16, r);
            let r = check_matmul_tt(gpu, inp, n, c_in, c_out);
            push("matmul (A^T B^T)", "f32", shape, BOUND_FP32, r);
        }
    }
    // A decode step's products of a few rows on the tensor cores: SmolLM2-135M's and
    // Llama-3.2-1B's projections at batches 1 to 64 (row counts off the 8-row tiles too), written
    // and added into the output, and the gate/up product fused with the row's norm and SwiGLU;
    // blocks of 8 and of 16 warps (k over one round of an 8-warp block's loads, one block an SM).
    for (rows, k, n, accumulate) in [
        (1, 576, 960, false),
        (7, 576, 576, true),
        (64, 1536, 576, true),
        (33, 2048, 3072, false),
        (64, 576, 960, false),
        (16, 8192, 2048, true),
        (1, 1536, 576, true),
    ] {
        let shape = format!("{rows}x{k}->{n}{}", if accumulate { " +=" } else { "" });
        if wants("few_rows_product") {
            let r = check_few_rows_product::<Bf16>(gpu, inp, rows, k, n, accumulate);
            push("few_rows_product", "bf16", shape.clone(), BOUND_BF16, r);
            let r = check_few_rows_product::<F16>(gpu, inp, rows, k, n, accumulate);
            push("few_rows_product", "f16", shape, BOUND_F16, r);
        }
    }
    for (rows, k, f) in [
        (1, 576, 1536),
        (64, 576, 1536),
        (50, 544, 1536),
        (20, 2048, 8192),
        (9, 64, 16),
        (16, 576, 1536),
        (4, 2048, 2048),
    ] {
        let shape = format!("{rows}x{k}->2x{f}");
        if wants("few_rows_swiglu") {
            let r = check_few_rows_swiglu::<Bf16>(gpu, inp, rows, k, f);
            push("few_rows_swiglu", "bf16", shape.clone(), BOUND_BF16, r);
            let r = check_few_rows_swiglu::<F16>(gpu, inp, rows, k, f);
            push("few_rows_swiglu", "f16", shape, BOUND_F16, r);
        }
    }
    // The decode MLP's chain (fused gate/up, then the down product added into the stream),
    // three layers, launched overlapped where the GPU can (engine/cuda/overlap.rs): the same
    // bits as plain launches, and the CPU's chain within the bound.
    for (rows, k, f) in [(1, 576, 1536), (64, 576, 1536), (8, 2048, 8192)] {
        let shape = format!("3 x {rows}x{k}->2x{f}->{k}");
        if wants("few_rows chain (overlapped)") {
            let r = check_overlapped_chain::<Bf16>(gpu, inp, rows, k, f);
            push(
                "few_rows chain (overlapped)",
                "bf16",
                shape.clone(),
                BOUND_BF16,
                r,
            );
            let r = check_overlapped_chain::<F16>(gpu, inp, rows, k, f);
            push("few_rows chain (overlapped)", "f16", shape, BOUND_F16, r);
        }
    }
    // A product with the GELU in its epilogue, and the backward through it: GPT-2's MLP
    // (768 -> 3072 and back), a shape whose widths are multiples of 8 (the epilogue's), and one
    // whose are not (the separate kernels).
    if wants("linear_gelu") {
        for (n, c, hidden) in [(512, 768, 3072), (37, 56, 24), (37, 53, 29)] {
            let shape = format!("{n}x{c}->{hidden}");
            for (label, math, b) in [
                ("f32", GemmMath::Fp32, BOUND_FP32),
                ("tf32", GemmMath::Tf32, BOUND_TF32),
            ] {
                let r = check_linear_gelu::<f32>(gpu, inp, n, c, hidden, math);
                push("linear_gelu", label, shape.clone(), b, r);
            }
            let r = check_linear_gelu::<Bf16>(gpu, inp, n, c, hidden, GemmMath::Fp32);
            push("linear_gelu", "bf16", shape.clone(), BOUND_BF16, r);
            let r = check_linear_gelu::<F16>(gpu, inp, n, c, hidden, GemmMath::Fp32);
            push("linear_gelu", "f16", shape, BOUND_F16, r);
        }
    }
    // The unfused attention's products: S = Q K^T (GPT-2's 12 heads of 64 at T = 1024 over
    // a batch of 4), P^T dO, and ragged sizes in every transpose combination.
    for (trans_a, trans_b, batch, m, n, k) in [
        (false, true, 48, 1024, 1024, 64),
        (true, false, 48, 1024, 64, 1024),
        (false, false, 7, 77, 33, 130),
        (true, true, 3, 45, 19, 70),
    ] {
        let g = GemmShape {
            trans_a,
            trans_b,
            batch,
            m,
            n,
            k,
        };
        let shape = format!(
            "{batch} x {}{m}x{k} {}{k}x{n}",
            if trans_a { "T " } else { "" },
            if trans_b { "T " } else { "" }
        );
        if wants("matmul_batched") {
            let r = check_matmul_batched::<f32>(gpu, inp, g);
            push("matmul_batched", "f32", shape.clone(), BOUND_FP32, r);
            let r = check_matmul_batched::<Bf16>(gpu, inp, g);
            push("matmul_batched", "bf16", shape, BOUND_BF16, r);
        }
    }
    // Products on column blocks of wider matrices (an adapter's columns of a fused projection),
    // added into a block of C (beta 1): the adapter's forward, dh, dB and dx; the last with
    // an odd column offset, so the operands are not 16-byte aligned.
    for (trans_a, trans_b, m, n, k, off) in [
        (false, true, 1000, 192, 16, 576),
        (false, false, 1000, 16, 192, 576),
        (true, false, 192, 16, 1000, 576),
        (false, false, 77, 45, 16, 3),
    ] {
        let g = GemmShape::single(trans_a, trans_b, m, n, k);
        let shape = format!(
            "{}{m}x{k} {}{k}x{n} at column {off}",
            if trans_a { "T " } else { "" },
            if trans_b { "T " } else { "" }
        );
        if wants("matmul_view") {
            let r = check_matmul_view::<f32, f32>(gpu, inp, g, off);
            push("matmul_view", "f32", shape.clone(), BOUND_FP32, r);
            let r = check_matmul_view::<Bf16, Bf16>(gpu, inp, g, off);
            push("matmul_view", "bf16", shape.clone(), BOUND_BF16, r);
            let r = check_matmul_view::<Bf16, f32>(gpu, inp, g, off);
            push("matmul_view", "bf16 into f32", shape, BOUND_BF16, r);
        }
    }
    // The last shape has head size 64 (the tensor-core path in bf16) and a ragged last tile.
    for (b, t, nh, c) in [
        (4, 1024, 12, 768),
        (3, 77, 2, 32),
        (2, 130, 4, 64),
        (2, 200, 2, 128),
    ] {
        let shape = format!("B{b} T{t} H{nh} C{c}");
        let s = AttnShape {
            batch: b,
            seq: t,
            heads: nh,
            channels: c,
        };
        if wants("attention_forward") || wants("attention_backward") {
            let (fwd, bwd) = check_attention::<f32>(gpu, inp, s, 0, GemmMath::Fp32);
            let bound = f32_attention_bound(gpu, s.head_size());
            push("attention_forward", "f32", shape.clone(), bound, fwd);
            push("attention_backward", "f32", shape.clone(), bound, bwd);
            if gpu.attention_uses_tensor_cores(s.head_size()) {
                let (fwd, bwd) = check_attention::<f32>(gpu, inp, s, 0, GemmMath::Tf32);
                push(
                    "attention_forward",
                    "tf32",
                    shape.clone(),
                    BOUND_TF32_ATTENTION,
                    fwd,
                );
                push(
                    "attention_backward",
                    "tf32",
                    shape.clone(),
                    BOUND_TF32_ATTENTION,
                    bwd,
                );
            }
            let (fwd, bwd) = check_attention::<Bf16>(gpu, inp, s, 0, GemmMath::Fp32);
            push("attention_forward", "bf16", shape.clone(), BOUND_BF16, fwd);
            push("attention_backward", "bf16", shape.clone(), BOUND_BF16, bwd);
            let (fwd, bwd) = check_attention::<F16>(gpu, inp, s, 0, GemmMath::Fp32);
            push("attention_forward", "f16", shape.clone(), BOUND_F16, fwd);
            push("attention_backward", "f16", shape, BOUND_F16, bwd);
        }
    }
    // The f16 Hopper backward's bound on each head's |V_j| (sm_90 only), at head sizes 64 and
    // 128, sequences ending inside a block.
    if gpu.info().arch() == 90 && wants("attention_value_bound") {
        for (b, t, nh, c) in [(2, 520, 4, 256), (3, 333, 2, 256)] {
            let s = AttnShape {
                batch: b,
                seq: t,
                heads: nh,
                channels: c,
            };
            let r = check_attention_value_bound(gpu, inp, s);
            push(
                "attention_value_bound",
                "f16",
                format!("B{b} T{t} H{nh} C{c}"),
                BOUND_FP32,
                r,
            );
        }
    }
    // Sliding-window attention (Mistral, Qwen2): windows shorter than a tile, not a multiple
    // of one, and longer than several, over head sizes 64 (the tensor cores in bf16) and 32;
    // then a window of the whole sequence, which must change nothing, bit for bit.
    for (b, t, nh, c, window) in [
        (2, 192, 4, 256, 64),
        (2, 300, 2, 128, 100),
        (1, 257, 2, 128, 17),
        (2, 200, 4, 128, 37),
        (1, 130, 3, 96, 1),
    ] {
        let shape = format!("B{b} T{t} H{nh} C{c} W{window}");
        let s = AttnShape {
            batch: b,
            seq: t,
            heads: nh,
            channels: c,
        };
        if wants("attention_forward_window") || wants("attention_backward_window") {
            let (fwd, bwd) = check_attention::<f32>(gpu, inp, s, window, GemmMath::Fp32);
            let bound = f32_attention_bound(gpu, s.head_size());
            push("attention_forward_window", "f32", shape.clone(), bound, fwd);
            push(
                "attention_backward_window",
                "f32",
                shape.clone(),
                bound,
                bwd,
            );
            if gpu.attention_uses_tensor_cores(s.head_size()) {
                let (fwd, bwd) = check_attention::<f32>(gpu, inp, s, window, GemmMath::Tf32);
                let bound = BOUND_TF32_ATTENTION;
                push(
                    "attention_forward_window",
                    "tf32",
                    shape.clone(),
                    bound,
                    fwd,
                );
                push(
                    "attention_backward_window",
                    "tf32",
                    shape.clone(),
                    bound,
                    bwd,
                );
            }
            let (fwd, bwd) = check_attention::<Bf16>(gpu, inp, s, window, GemmMath::Fp32);
            push(
                "attention_forward_window",
                "bf16",
                shape.clone(),
                BOUND_BF16,
                fwd,
            );
            push(
                "attention_backward_window",
                "bf16",
                shape.clone(),
                BOUND_BF16,
                bwd,
            );
            let (fwd, bwd) = check_attention::<F16>(gpu, inp, s, window, GemmMath::Fp32);
            push(
                "attention_forward_window",
                "f16",
                shape.clone(),
                BOUND_F16,
                fwd,
            );
            push("attention_backward_window", "f16", shape, BOUND_F16, bwd);
        }
    }
    for (b, t, nh, c) in [(2, 200, 4, 256), (2, 77, 2, 64)] {
        let shape = format!("B{b} T{t} H{nh} C{c} W{t} vs none");
        let s = AttnShape {
            batch: b,
            seq: t,
            heads: nh,
            channels: c,
        };
        both_dtypes!(
            check_attention_full_window,
            "attention_full_window",
            shape,
            s,
            GemmMath::Fp32
        );
    }
    // Every attention kernel sums in a fixed order (atomics only take maxima or hand out work):
    // two runs agree bit for bit (bound 0), here on long sequences with thousands of blocks, at
    // head sizes 64 and 128.
    if wants("attention_repeatable") {
        for (heads, channels) in [(12, 768), (16, 2048)] {
            let s = AttnShape {
                batch: 4,
                seq: 4096,
                heads,
                channels,
            };
            for (dtype, result) in [
                ("f32", check_attention_repeatable::<f32>(gpu, inp, s)),
                ("bf16", check_attention_repeatable::<Bf16>(gpu, inp, s)),
                ("f16", check_attention_repeatable::<F16>(gpu, inp, s)),
            ] {
                let shape = format!("B4 T4096 H{heads} C{channels} twice");
                push("attention_repeatable", dtype, shape, 0.0, result);
            }
        }
    }
    // The tensor-core kernels at head sizes 64 and 128 in f32 (both product kinds), bf16 and
    // f16 (and 96, Phi-3-mini's, in bf16 and f16: the mma.sync kernels on every GPU), on the layout
    // grouped-query attention gives them: 8 query heads over 2 key/value heads, each key/value
    // head repeated over its 4 query heads as rope_expand packs them. Sequence ends that are no
    // multiple of a tile (64 rows; 32-row key tiles at head size 128), windows longer than a
    // block, and one shorter than a 64-row block but longer than a 32-row tile.
    for (b, t, heads, kv_heads, hs, window) in [
        (2, 520, 8, 2, 128, 0),
        (2, 300, 8, 2, 128, 100),
        (1, 333, 8, 2, 128, 37),
        (2, 520, 8, 2, 64, 0),
        (2, 300, 8, 2, 64, 100),
        (2, 520, 8, 2, 96, 0),
        (1, 333, 8, 2, 96, 37),
    ] {
        let s = AttnShape {
            batch: b,
            seq: t,
            heads,
            channels: heads * hs,
        };
        let (forward, backward, shape) = if window > 0 {
            (
                "attention_forward_gqa_window",
                "attention_backward_gqa_window",
                format!("B{b} T{t} H{heads}/{kv_heads} D{hs} W{window}"),
            )
        } else {
            (
                "attention_forward_gqa",
                "attention_backward_gqa",
                format!("B{b} T{t} H{heads}/{kv_heads} D{hs}"),
            )
        };
        if wants(forward) || wants(backward) {
            // Head size 96 has 16-bit kernels only (f32 runs the unfused chain there).
            let f32_kernels = crate::engine::cuda::attention::has_kernel(hs, DType::F32);
            for (label, math, bound) in [
                ("f32", GemmMath::Fp32, BOUND_3XTF32_ATTENTION),
                ("tf32", GemmMath::Tf32, BOUND_TF32_ATTENTION),
            ]
            .into_iter()
            .filter(|_| f32_kernels)
            {
                let (fwd, bwd) =
                    check_attention_grouped::<f32>(gpu, inp, s, kv_heads, window, math);
                push(forward, label, shape.clone(), bound, fwd);
                push(backward, label, shape.clone(), bound, bwd);
            }
            let (fwd, bwd) =
                check_attention_grouped::<Bf16>(gpu, inp, s, kv_heads, window, GemmMath::Fp32);
            push(forward, "bf16", shape.clone(), BOUND_BF16, fwd);
            push(backward, "bf16", shape.clone(), BOUND_BF16, bwd);
            // f16's bound holds per head vector: P (times 2^12) and dS (scaled per row) rounded
            // to f16 keep 11 bits, as the output's own rounding does.
            let (fwd, bwd) =
                check_attention_grouped::<F16>(gpu, inp, s, kv_heads, window, GemmMath::Fp32);
            push(forward, "f16", shape.clone(), BOUND_F16, fwd);
            push(backward, "f16", shape, BOUND_F16, bwd);
        }
    }
    // f16's range: score gradients dS past f16's largest value, as fp16-mixed's loss scale
    // gives them, with dQ, dK and dV inside it.
    for (t, heads, hs) in [(256, 4, 128), (256, 4, 64)] {
        let s = AttnShape {
            batch: 1,
            seq: t,
            heads,
            channels: heads * hs,
        };
        if wants("attention_backward_large_ds") {
            push(
                "attention_backward_large_ds",
                "f16",
                format!("B1 T{t} H{heads} D{hs} dS>65504"),
                BOUND_F16,
                check_attention_large_ds::<F16>(gpu, inp, s),
            );
        }
    }
    // A window of the whole sequence changes nothing at head size 128 either (the tensor-core
    // kernels only: the CUDA-core ones have no head size 128).
    let s = AttnShape {
        batch: 2,
        seq: 200,
        heads: 2,
        channels: 256,
    };
    let shape = "B2 T200 H2 C256 W200 vs none".to_string();
    if wants("attention_full_window") {
        for (label, math) in [("f32", GemmMath::Fp32), ("tf32", GemmMath::Tf32)] {
            let r = check_attention_full_window::<f32>(gpu, inp, s, math);
            push("attention_full_window", label, shape.clone(), 0.0, r);
        }
        let r = check_attention_full_window::<Bf16>(gpu, inp, s, GemmMath::Fp32);
        push("attention_full_window", "bf16", shape.clone(), 0.0, r);
        let r = check_attention_full_window::<F16>(gpu, inp, s, GemmMath::Fp32);
        push("attention_full_window", "f16", shape, 0.0, r);
    }
    // Encoder operations. Layernorm with BERT's eps of 1e-12 on rows of small spread (GPT-2's
    // 1e-5 would change their rstd several-fold, so a lost eps shows), plain and residual.
    for (n, c) in [(512, 384), (37, 1001)] {
        let shape = format!("{n}x{c} eps 1e-12");
        both_dtypes!(
            check_layernorm_eps,
            "layernorm_forward_eps",
            shape,
            n,
            c,
            1e-12
        );
    }
    for n in [(1 << 20) + 3, 1000] {
        both_dtypes!(
            check_gelu_erf_forward,
            "gelu_erf_forward",
            &format!("{n}"),
            n
        );
        both_dtypes!(
            check_gelu_erf_backward,
            "gelu_erf_backward",
            &format!("{n}"),
            n
        );
    }
    // Padding masks: full, ragged and single-token sequences; MiniLM's 12 heads of 32, and
    // head sizes 16 and 64 with lengths past one tile of keys.
    for (b, t, nh, c, lens) in [
        (4, 64, 12, 384, vec![64, 17, 1, 33]),
        (3, 77, 2, 32, vec![5, 77, 40]),
        (2, 130, 4, 256, vec![130, 65]),
    ] {
        let shape = format!("B{b} T{t} H{nh} C{c}");
        let s = AttnShape {
            batch: b,
            seq: t,
            heads: nh,
            channels: c,
        };
        both_dtypes!(
            check_masked_attention,
            "masked_attention_forward",
            shape,
            s,
            &lens
        );
        both_dtypes!(check_padded_softmax, "padded_softmax", shape, s, &lens);
        both_dtypes!(
            check_softmax_backward_rows,
            "softmax_backward_rows",
            shape,
            s,
            &lens
        );
    }
    // The fused kernels (one team of warps per sequence, staged in shared memory): N = 1,
    // ragged N (chunks past the end, teams past the batch), several sequences per block (N up
    // to 512), teams of 2, 4, 8 and 16 warps (N = 1000, 2048, 4096, 8192), with and without
    // off-diagonals; N = 20000 is past their limits (the forward's shared memory on every
    // supported GPU, the backward's 16 positions per thread) and takes the multi-launch path,
    // whose chunk scan then spans more chunks than a warp has lanes.
    for (batch, n, causal, off) in [
        (3, 1000, false, true),
        (2, 1000, true, true),
        (4, 1, false, true),
        (64, 100, false, true),
        (5, 37, true, true),
        (9, 128, true, false),
        (17, 512, false, false),
        (3, 2048, false, true),
        (2, 4096, true, false),
        (1, 8192, false, true),
        (2, 8192, true, true),
        (3, 8192, false, false),
        (1, 20000, false, true),
        (2, 20000, true, false),
        // The warp kernels (unit off-diagonals, small calls, N of 128, 256 or 512), with
        // warps past the batch in the last block.
        (8, 128, false, false),
        (3, 256, true, false),
        (6, 256, false, false),
        (5, 512, true, false),
        // The long-chunk kernels (unit off-diagonals, calls above 2^17 positions, N a multiple
        // of 32 chunks): several sequences per block with some past the batch, blocks of 4 to
        // 16 warps per sequence, chunks of 16, 32 and 64 positions (the last two only in
        // calls of millions of positions), both modes.
        (65, 2048, false, false),
        (66, 2048, true, false),
        (33, 4096, false, false),
        (17, 8192, false, false),
        (17, 8192, true, false),
        (9, 16384, false, false),
        (256, 8192, false, false),
        (512, 8192, true, false),
    ] {
        let shape = format!(
            "B{batch} N{n} {}{}",
            if causal { "causal" } else { "full" },
            if off { "" } else { " unit off-diag" }
        );
        if wants("bk_core_forward") || wants("bk_core_backward") {
            let (fwd, bwd) = check_bk_core(gpu, inp, BkShape { batch, n, causal }, off, 3.0, 0.5);
            push("bk_core_forward", "f32", shape.clone(), BOUND_BK, fwd);
            push("bk_core_backward", "f32", shape, BOUND_BK, bwd);
        }
    }
    // Inputs at the edges of the unit-off-diagonal kernels' numerics, full mode: a potential
    // up to 2e9 (the long-chunk kernels renormalise their maps twice as often once some |s|
    // reaches 1e9; the warp kernels renormalise on every second step), and a small Im z,
    // where |r| and |q| can come down to Im z.
    for (batch, n, v_scale, z_im_min, what) in [
        (64, 8192, 2e9, 0.5, "v up to 2e9"),
        (4, 128, 2e9, 0.5, "v up to 2e9"),
        (65, 2048, 3.0, 0.1, "Im z in [0.1, 0.2)"),
        (17, 8192, 3.0, 0.1, "Im z in [0.1, 0.2)"),
    ] {
        let s = BkShape {
            batch,
            n,
            causal: false,
        };
        if wants("bk_core_forward") || wants("bk_core_backward") {
            let (fwd, bwd) = check_bk_core(gpu, inp, s, false, v_scale, z_im_min);
            let shape = format!("B{batch} N{n} full unit off-diag, {what}");
            push("bk_core_forward", "f32", shape.clone(), BOUND_BK, fwd);
            push("bk_core_backward", "f32", shape, BOUND_BK, bwd);
        }
    }
    if wants("bk_core (NaN flag)") {
        push(
            "bk_core (NaN flag)",
            "f32",
            "B2 N300".into(),
            0.0,
            check_bk_core_flags_nan(gpu, inp),
        );
    }
    rows
}

//! The ResNet-BK step as a walk of allocations: `ResnetBk::forward_backward` and the
//! optimizer step, tensor by tensor, in the order `models/resnet_bk.rs`, `nn/moe.rs`,
//! `nn/bk_core.rs` and `engine/ops.rs` allocate and drop them. As with the GPT's walk, the
//! exactness test against real CPU steps is what notices a change there.
//!
//! The mixture-of-experts layers allocate per expert as many rows as the expert received
//! tokens, which depends on the data. The walk takes each layer's expert loads; a plan uses
//! [`worst_case_loads`], the most any routing can give (every slot kept, the experts filled
//! to capacity one after the other), so a plan is an upper bound that routing can only
//! undercut. With given loads the walk is exact.

use super::gpt::{END_OF_FORWARD, StepSpec};
use super::walk::{Id, Kind, Walk};
use crate::engine::{DType, Device};
use crate::models::resnet_bk::ResnetBkConfig;
use crate::nn::moe::MoeConfig;

/// Rows per chunk of the GPU's column reductions (`cuda/reduce.rs`), as in the GPT's walk.
const GPU_REDUCE_ROWS_PER_CHUNK: usize = 64;
/// The most f64 partials the GPU's gradient-norm reduction takes (`cuda/reduce.rs`).
const GPU_SUM_SQUARES_PARTIALS: usize = 1024;

/// Every tensor the model allocates as a weight, in construction order: its name, element
/// count, and whether it is a trained parameter (the BK-Core's fixed `z` is not, yet it has
/// a value and a gradient buffer).
pub fn weight_shapes(cfg: &ResnetBkConfig) -> Vec<(String, usize, bool)> {
    let c = cfg.d_model;
    let m = &cfg.moe;
    let padded = super::padded_vocab(cfg.vocab);
    let mut v = vec![
        ("wte.weight".to_string(), padded * c, true),
        ("wpe.weight".to_string(), cfg.context * c, true),
    ];
    for l in 0..cfg.n_layers {
        let b = format!("blocks.{l}");
        v.push((format!("{b}.ln.weight"), c, true));
        v.push((format!("{b}.ln.bias"), c, true));
        v.push((format!("{b}.moe.router.weight"), m.experts * c, true));
        for e in 0..m.experts {
            let x = format!("{b}.moe.experts.{e}");
            v.push((format!("{x}.fc.weight"), m.hidden * c, true));
            v.push((format!("{x}.fc.bias"), m.hidden, true));
            v.push((format!("{x}.proj.weight"), c * m.hidden, true));
            v.push((format!("{x}.proj.bias"), c, true));
        }
        v.push((format!("{b}.v_proj.weight"), c, true));
        v.push((format!("{b}.v_proj.bias"), 1, true));
        v.push((format!("{b}.bk.z"), 2, false));
        v.push((format!("{b}.out_proj.weight"), 2 * c, true));
        v.push((format!("{b}.scale"), 1, true));
    }
    v.push(("ln_f.weight".into(), c, true));
    v.push(("ln_f.bias".into(), c, true));
    if !cfg.tied_head {
        v.push(("lm_head.weight".into(), padded * c, true));
    }
    v
}

/// The trained parameters' names and element counts, in the model's order.
pub fn param_shapes(cfg: &ResnetBkConfig) -> Vec<(String, usize)> {
    weight_shapes(cfg)
        .into_iter()
        .filter(|w| w.2)
        .map(|(name, n, _)| (name, n))
        .collect()
}

/// The most token slots each expert of one layer can hold for `tokens` tokens (see
/// [`crate::nn::moe::worst_case_loads`], which a meta step routes by too).
pub fn worst_case_loads(m: &MoeConfig, tokens: usize) -> Vec<usize> {
    crate::nn::moe::worst_case_loads(tokens, m.experts, m.top_k, m.capacity(tokens))
}

/// One block's saved activations, as handles.
struct BlockSaves {
    input: Id,
    rest: Vec<Id>,
    loads: Vec<usize>,
}

struct Step<'a> {
    w: &'a mut Walk,
    cfg: &'a ResnetBkConfig,
    s: StepSpec,
    gpu: bool,
}

impl Step<'_> {
    fn tokens(&self) -> usize {
        self.s.batch * self.s.seq
    }

    /// `rows x width` activation values in the dtype the kernels give them.
    fn act(&mut self, what: String, kind: Kind, rows: usize, width: usize) -> Id {
        let bytes = self.s.layout.act_bytes(rows * width);
        self.w.alloc(what, kind, bytes)
    }

    fn f32s(&mut self, what: String, kind: Kind, n: usize) -> Id {
        self.w.alloc(what, kind, 4 * n)
    }

    /// A layernorm's output and its mean and rstd (one f32 each per row).
    fn norm(&mut self, what: &str) -> Vec<Id> {
        let n = self.tokens();
        vec![
            self.act(format!("{what} output"), Kind::Saved, n, self.cfg.d_model),
            self.f32s(format!("{what} mean"), Kind::Saved, n),
            self.f32s(format!("{what} rstd"), Kind::Saved, n),
        ]
    }

    fn gpu_scratch(&mut self, what: &str, bytes: usize) {
        if self.gpu {
            self.w.scratch(what, bytes);
        }
    }

    /// The column-sum partials of a bias or layernorm parameter gradient over `rows` rows.
    fn gpu_partials(&mut self, what: &str, rows: usize, columns: usize) {
        let chunks = rows.div_ceil(GPU_REDUCE_ROWS_PER_CHUNK).max(1);
        self.gpu_scratch(what, chunks * columns * 4);
    }

    /// Token indices (and gate weights when `gated`) a row gather or scatter uploads.
    fn gpu_upload(&mut self, what: &str, rows: usize, gated: bool) {
        self.gpu_scratch(what, rows * if gated { 8 } else { 4 });
    }

    /// `Moe::forward`: the router's logits (read on the host, dropped), the zeroed output
    /// the experts add into, then per expert with tokens its packed input, MLP activations
    /// and output, all kept. Returns the output and the kept handles.
    fn moe_forward(&mut self, b: &str, loads: &[usize]) -> (Id, Vec<Id>) {
        let (n, c, m) = (self.tokens(), self.cfg.d_model, self.cfg.moe);
        let logits = self.act(
            format!("{b}.moe router logits"),
            Kind::Transient,
            n,
            m.experts,
        );
        self.w.free(logits);
        let out = self.act(format!("{b}.moe output"), Kind::Transient, n, c);
        let mut saved = Vec::new();
        for (e, &rows) in loads.iter().enumerate().filter(|l| *l.1 > 0) {
            let x = format!("{b}.moe.experts.{e}");
            self.gpu_upload("gather indices", rows, false);
            saved.push(self.act(format!("{x} input"), Kind::Saved, rows, c));
            saved.push(self.act(format!("{x} pre-activation"), Kind::Saved, rows, m.hidden));
            saved.push(self.act(format!("{x} gelu"), Kind::Saved, rows, m.hidden));
            saved.push(self.act(format!("{x} output"), Kind::Saved, rows, c));
            self.gpu_upload("scatter indices and gates", rows, true);
        }
        (out, saved)
    }

    /// `ResnetBk::block_forward` and the next norm: returns the next stream and its norm.
    fn block_forward(&mut self, l: usize, loads: &[usize]) -> (Id, Vec<Id>, Vec<Id>) {
        let (n, c) = (self.tokens(), self.cfg.d_model);
        let b = format!("blocks.{l}");
        let (delta, mut saved) = self.moe_forward(&b, loads);
        // Shadowed, not dropped: each of these lives until `block_forward` returns.
        let v = self.act(format!("{b}.v_proj output"), Kind::Transient, n, 1);
        let v32 = self.f32s(format!("{b} potentials"), Kind::Transient, n);
        let g = self.f32s(format!("{b}.bk output G"), Kind::Transient, 2 * n);
        saved.push(self.f32s(format!("{b}.bk saved potentials"), Kind::Saved, n));
        saved.push(self.act(format!("{b} scale * G"), Kind::Saved, n, 2));
        let out = self.act(format!("{b}.out_proj output"), Kind::Transient, n, c);
        self.w.free(out);
        self.w.free_all([v, v32, g]);
        let next_name = if l + 1 < self.cfg.n_layers {
            format!("blocks.{}.ln", l + 1)
        } else {
            "ln_f".into()
        };
        let next = self.act(format!("{next_name} input"), Kind::Saved, n, c);
        let norm = self.norm(&next_name);
        self.w.free(delta);
        (next, saved, norm)
    }

    /// `BkBlock::backward` and the block norm's backward; frees the block's saves.
    fn block_backward(&mut self, l: usize, block: BlockSaves) {
        let (n, c, m) = (self.tokens(), self.cfg.d_model, self.cfg.moe);
        let b = format!("blocks.{l}");
        let d_gs = self.act(format!("{b} scale * G gradient"), Kind::Transient, n, 2);
        self.w.free(d_gs);
        let d_g = self.f32s(format!("{b}.bk output gradient"), Kind::Transient, 2 * n);
        let dv32 = self.f32s(format!("{b} potential gradient"), Kind::Transient, n);
        let dv = self.act(format!("{b}.v_proj output gradient"), Kind::Transient, n, 1);
        let d_ln = self.act(format!("{b}.ln output gradient"), Kind::Transient, n, c);
        self.gpu_partials("v_proj bias-gradient partials", n, 1);
        // Moe::backward: the gate gradients (host), the router logits' gradient, the
        // router's input gradient, then each expert's backward, scattered into it.
        for &rows in block.loads.iter().filter(|&&rows| rows > 0) {
            self.gpu_upload("gathered row-dot indices", rows, false);
            self.gpu_scratch("gathered row-dot output", 4 * rows);
        }
        let dlogits = self.act(
            format!("{b}.moe router logits gradient"),
            Kind::Transient,
            n,
            m.experts,
        );
        let dx = self.act(format!("{b}.moe input gradient"), Kind::Transient, n, c);
        self.w.free(dlogits);
        for (e, &rows) in block.loads.iter().enumerate().filter(|l| *l.1 > 0) {
            let x = format!("{b}.moe.experts.{e}");
            self.gpu_upload("gather indices and gates", rows, true);
            let dout = self.act(format!("{x} output gradient"), Kind::Transient, rows, c);
            let dact = self.act(
                format!("{x} gelu gradient"),
                Kind::Transient,
                rows,
                m.hidden,
            );
            self.gpu_partials("expert proj bias-gradient partials", rows, c);
            let dpre = self.act(
                format!("{x} pre-activation gradient"),
                Kind::Transient,
                rows,
                m.hidden,
            );
            let dinput = self.act(format!("{x} input gradient"), Kind::Transient, rows, c);
            self.gpu_partials("expert fc bias-gradient partials", rows, m.hidden);
            self.w.free_all([dact, dpre]);
            self.gpu_upload("scatter indices", rows, false);
            self.w.free_all([dout, dinput]);
        }
        self.w.free(dx);
        self.w.free_all([d_g, dv32, dv]);
        self.gpu_partials("ln parameter-gradient partials", n, 2 * c);
        self.w.free(d_ln);
        self.w.free(block.input);
        self.w.free_all(block.rest);
    }

    fn run(&mut self, loads: &[Vec<usize>]) {
        let (n, c) = (self.tokens(), self.cfg.d_model);
        let s = self.s;
        if s.gemm_workspace > 0 {
            self.w.outside("cuBLASLt workspace", s.gemm_workspace);
        }
        self.persistent();

        // Forward: embedding, the first norm, then each block fused with the next norm.
        self.gpu_scratch("token ids", 4 * n);
        let mut input = self.act("blocks.0 input".into(), Kind::Saved, n, c);
        let first = if self.cfg.n_layers > 0 {
            "blocks.0.ln"
        } else {
            "ln_f"
        };
        let mut norm = self.norm(first);
        let mut blocks = Vec::with_capacity(self.cfg.n_layers);
        for (l, layer_loads) in loads.iter().enumerate() {
            let (next, saved, next_norm) = self.block_forward(l, layer_loads);
            let mut rest = std::mem::replace(&mut norm, next_norm);
            rest.extend(saved);
            blocks.push(BlockSaves {
                input,
                rest,
                loads: layer_loads.clone(),
            });
            input = next;
        }
        self.w.mark(END_OF_FORWARD);

        // Loss: the logits buffer becomes its own gradient in place; the final norm's
        // input and output live until the end of the step.
        let padded = super::padded_vocab(self.cfg.vocab);
        let logits = self.act(
            "logits (and their gradient)".into(),
            Kind::Transient,
            n,
            padded,
        );
        self.gpu_scratch("cross-entropy losses and targets", 8 * n);
        let d_ln_f = self.act("ln_f output gradient".into(), Kind::Transient, n, c);
        self.w.free(logits);
        let dstream = self.act("residual stream gradient".into(), Kind::Transient, n, c);
        self.gpu_partials("ln_f parameter-gradient partials", n, 2 * c);

        while let Some(block) = blocks.pop() {
            self.block_backward(blocks.len(), block);
        }
        self.gpu_scratch("token ids", 4 * n);
        self.w.free_all([dstream, d_ln_f, input]);
        self.w.free_all(norm);
        // The optimizer step: the gradient norm's partials, then the in-place AdamW pass.
        self.gpu_scratch("gradient-norm partials", 8 * GPU_SUM_SQUARES_PARTIALS + 16);
    }

    /// Weights, gradients, compute copies and optimizer state as `ResnetBk::new` and
    /// `Trainer::new` allocate them. The BK-Core's `z` is made as zeros and then replaced
    /// by its value, which briefly holds both.
    fn persistent(&mut self) {
        let compute = self.s.layout.weights;
        let shapes = weight_shapes(self.cfg);
        let mut masters = Vec::new();
        for (name, n, param) in &shapes {
            let m = self.w.alloc(format!("{name} master"), Kind::Master, 4 * n);
            self.w.alloc(format!("{name} gradient"), Kind::Grad, 4 * n);
            if *param {
                masters.push((name, *n, m));
            } else {
                self.w.alloc(format!("{name} value"), Kind::Master, 4 * n);
                self.w.free(m);
            }
        }
        if self.s.offload {
            // One parameter at a time: its compute copy is made and its master leaves for
            // the host (under fp32 the master itself becomes the compute copy).
            for (name, n, master) in masters {
                if compute == DType::F32 {
                    self.w.free(master);
                    self.w
                        .alloc(format!("{name} compute copy"), Kind::Compute, 4 * n);
                } else {
                    self.w.alloc(
                        format!("{name} compute copy"),
                        Kind::Compute,
                        compute.size_bytes() * n,
                    );
                    self.w.free(master);
                }
            }
            return;
        }
        if compute != DType::F32 {
            for (name, n, _) in &masters {
                self.w.alloc(
                    format!("{name} compute copy"),
                    Kind::Compute,
                    compute.size_bytes() * n,
                );
            }
        }
        for (name, n, _) in &masters {
            self.w
                .alloc(format!("{name} AdamW moments"), Kind::Optimizer, 8 * n);
        }
    }
}

/// Walks one training step of `cfg` whose layers route `loads[l][e]` token slots to expert
/// `e` of layer `l` ([`worst_case_loads`] for a plan). `cfg.vocab` is the tokenizer's.
pub fn walk_step(cfg: &ResnetBkConfig, s: StepSpec, loads: &[Vec<usize>]) -> Walk {
    assert_eq!(loads.len(), cfg.n_layers, "one expert load list per layer");
    let mut w = Walk::default();
    Step {
        w: &mut w,
        cfg,
        s,
        gpu: s.layout.device != Device::Cpu,
    }
    .run(loads);
    w
}

/// [`walk_step`] with every layer at [`worst_case_loads`].
pub fn walk_worst_case(cfg: &ResnetBkConfig, s: StepSpec) -> Walk {
    let loads = vec![worst_case_loads(&cfg.moe, s.batch * s.seq); cfg.n_layers];
    walk_step(cfg, s, &loads)
}

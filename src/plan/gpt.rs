//! The GPT step as a walk of allocations: `Gpt::forward_backward` and the optimizer step,
//! tensor by tensor, in the order `models/gpt.rs`, `nn/*.rs` and `engine/ops.rs` allocate and
//! drop them. A change there that allocates differently must change this walk too; the
//! exactness test (a real step's pool peak on the CPU against this walk's) is what notices.
//!
//! Recomputation (`train.recompute=blocks`) is walked as designed: the forward keeps each
//! block's input residual stream, and the backward re-runs the block's forward up to the MLP
//! activations before running its backward.

use super::walk::{Id, Kind, Walk};
use crate::engine::AttnShape;
use crate::engine::{DType, Device, ops};
use crate::models::gpt::GptConfig;
use crate::nn::ActLayout;

/// Rows per chunk of the GPU's two-pass column reductions (layernorm and bias gradients);
/// each chunk writes one f32 partial per column, outside the pool (`cuda/reduce.rs`).
const GPU_REDUCE_ROWS_PER_CHUNK: usize = 64;
/// The most f64 partials the GPU's gradient-norm reduction takes (`cuda/reduce.rs`).
const GPU_SUM_SQUARES_PARTIALS: usize = 1024;

/// Every parameter tensor's name and element count, in the model's order.
pub fn param_shapes(cfg: &GptConfig) -> Vec<(String, usize)> {
    let c = cfg.d_model;
    let mut v = vec![
        ("wte.weight".to_string(), cfg.padded_vocab() * c),
        ("wpe.weight".to_string(), cfg.context * c),
    ];
    for l in 0..cfg.n_layers {
        for (name, n) in [
            ("ln1.weight", c),
            ("ln1.bias", c),
            ("attn.qkv.weight", 3 * c * c),
            ("attn.qkv.bias", 3 * c),
            ("attn.proj.weight", c * c),
            ("attn.proj.bias", c),
            ("ln2.weight", c),
            ("ln2.bias", c),
            ("mlp.fc.weight", 4 * c * c),
            ("mlp.fc.bias", 4 * c),
            ("mlp.proj.weight", 4 * c * c),
            ("mlp.proj.bias", c),
        ] {
            v.push((format!("blocks.{l}.{name}"), n));
        }
    }
    v.push(("ln_f.weight".into(), c));
    v.push(("ln_f.bias".into(), c));
    if !cfg.tied_head {
        v.push(("lm_head.weight".into(), cfg.padded_vocab() * c));
    }
    v
}

/// The walk's mark after the forward, before the logits.
pub const END_OF_FORWARD: &str = "end of forward";

/// What one step is walked for.
#[derive(Debug, Clone, Copy)]
pub struct StepSpec {
    pub batch: usize,
    pub seq: usize,
    pub layout: ActLayout,
    pub recompute: bool,
    /// Master weights and AdamW moments live in host memory; the device keeps a compute
    /// copy of every weight (f32 when the policy computes in f32) and the gradients.
    pub offload: bool,
    /// The cuBLASLt workspace a GPU backend holds outside the pool (0 on the CPU).
    pub gemm_workspace: usize,
}

/// One block's saved activations, as handles.
struct BlockSaves {
    input: Id,
    rest: Vec<Id>,
}

struct Step<'a> {
    w: &'a mut Walk,
    cfg: &'a GptConfig,
    s: StepSpec,
    gpu: bool,
}

impl Step<'_> {
    fn tokens(&self) -> usize {
        self.s.batch * self.s.seq
    }

    fn act(&self, elems: usize) -> usize {
        self.s.layout.act_bytes(elems)
    }

    /// An activation of `width` values per token.
    fn alloc_act(&mut self, what: String, kind: Kind, width: usize) -> Id {
        let bytes = self.act(self.tokens() * width);
        self.w.alloc(what, kind, bytes)
    }

    /// Mean and rstd of a layernorm: one f32 each per row.
    fn alloc_stats(&mut self, what: &str, kind: Kind) -> [Id; 2] {
        let n = self.tokens() * 4;
        [
            self.w.alloc(format!("{what} mean"), kind, n),
            self.w.alloc(format!("{what} rstd"), kind, n),
        ]
    }

    fn gpu_scratch(&mut self, what: &str, bytes: usize) {
        if self.gpu {
            self.w.scratch(what, bytes);
        }
    }

    /// The column-sum partials of a bias gradient or layernorm parameter gradient.
    fn gpu_partials(&mut self, what: &str, columns: usize) {
        let chunks = self.tokens().div_ceil(GPU_REDUCE_ROWS_PER_CHUNK).max(1);
        self.gpu_scratch(what, chunks * columns * 4);
    }

    fn attn_stats_bytes(&self) -> usize {
        let shape = AttnShape {
            batch: self.s.batch,
            seq: self.s.seq,
            heads: self.cfg.n_heads,
            channels: self.cfg.d_model,
        };
        4 * ops::attention_stats_shape(self.s.layout.device, shape)
            .iter()
            .product::<usize>()
    }

    /// A block's forward from its normed input to the MLP activations: what its backward
    /// reads besides the input and the norm. Returns the saved handles in allocation order.
    fn block_body(&mut self, l: usize) -> Vec<Id> {
        let c = self.cfg.d_model;
        let b = format!("blocks.{l}");
        let mut saved = vec![self.alloc_act(format!("{b}.attn qkv"), Kind::Saved, 3 * c)];
        saved.push(self.alloc_act(format!("{b}.attn output"), Kind::Saved, c));
        let stats = self.attn_stats_bytes();
        saved.push(
            self.w
                .alloc(format!("{b}.attn softmax statistics"), Kind::Saved, stats),
        );
        let attn_out = self.alloc_act(format!("{b}.attn projection"), Kind::Transient, c);
        saved.push(self.alloc_act(format!("{b} residual after attention"), Kind::Saved, c));
        saved.push(self.alloc_act(format!("{b}.ln2 output"), Kind::Saved, c));
        saved.extend(self.alloc_stats(&format!("{b}.ln2"), Kind::Saved));
        self.w.free(attn_out);
        saved.push(self.alloc_act(format!("{b}.mlp pre-activation"), Kind::Saved, 4 * c));
        saved.push(self.alloc_act(format!("{b}.mlp gelu"), Kind::Saved, 4 * c));
        saved
    }

    fn run(&mut self) {
        let c = self.cfg.d_model;
        let n = self.tokens();
        let s = self.s;
        // The backend's GEMM workspace lives as long as the device is open.
        if s.gemm_workspace > 0 {
            self.w.outside("cuBLASLt workspace", s.gemm_workspace);
        }
        self.persistent();

        // Forward: embedding, the first norm, then each block fused with the next norm.
        self.gpu_scratch("token ids", 4 * n);
        let mut input = self.alloc_act("blocks.0 input".into(), Kind::Saved, c);
        let mut ln = vec![self.alloc_act("blocks.0.ln1 output".into(), Kind::Saved, c)];
        ln.extend(self.alloc_stats("blocks.0.ln1", Kind::Saved));
        let mut blocks: Vec<BlockSaves> = Vec::with_capacity(self.cfg.n_layers);
        for l in 0..self.cfg.n_layers {
            let mut rest = ln;
            rest.extend(self.block_body(l));
            let mlp_out = self.alloc_act(format!("blocks.{l}.mlp output"), Kind::Transient, c);
            let next_name = if l + 1 < self.cfg.n_layers {
                format!("blocks.{}", l + 1)
            } else {
                "ln_f".into()
            };
            let next = self.alloc_act(format!("{next_name} input"), Kind::Saved, c);
            ln = vec![self.alloc_act(format!("{next_name} output"), Kind::Saved, c)];
            ln.extend(self.alloc_stats(&next_name, Kind::Saved));
            self.w.free(mlp_out);
            if s.recompute {
                // Keep only the block's input; the norm output that feeds the next block
                // lives until that block has run.
                self.w.free_all(rest.drain(..));
            }
            blocks.push(BlockSaves { input, rest });
            input = next;
        }
        let (last, mut final_norm) = (input, ln);
        self.w.mark(END_OF_FORWARD);

        // Loss: the logits buffer becomes its own gradient in place.
        let logits = self.alloc_act(
            "logits (and their gradient)".into(),
            Kind::Transient,
            self.cfg.padded_vocab(),
        );
        self.gpu_scratch("cross-entropy losses and targets", 8 * n);
        let d_ln_f = self.alloc_act("ln_f output gradient".into(), Kind::Transient, c);
        self.w.free(logits);
        // The final norm's output is dropped once the head's backward has read it; its
        // input and gradient once the final norm's backward has run.
        let ln_f_output = final_norm.remove(0);
        self.w.free(ln_f_output);
        let dstream = self.alloc_act("residual stream gradient".into(), Kind::Transient, c);
        self.gpu_partials("ln_f parameter-gradient partials", 2 * c);
        self.w.free_all([last, d_ln_f]);

        while let Some(block) = blocks.pop() {
            let l = blocks.len();
            let b = format!("blocks.{l}");
            let mut rest = block.rest;
            if s.recompute {
                rest.push(self.alloc_act(format!("{b}.ln1 output"), Kind::Saved, c));
                rest.extend(self.alloc_stats(&format!("{b}.ln1"), Kind::Saved));
                rest.extend(self.block_body(l));
            }
            let dact = self.alloc_act(format!("{b}.mlp gelu gradient"), Kind::Transient, 4 * c);
            self.gpu_partials("mlp.proj bias-gradient partials", c);
            let dpre = self.alloc_act(
                format!("{b}.mlp pre-activation gradient"),
                Kind::Transient,
                4 * c,
            );
            let d_ln2 = self.alloc_act(format!("{b}.ln2 output gradient"), Kind::Transient, c);
            self.gpu_partials("mlp.fc bias-gradient partials", 4 * c);
            self.w.free_all([dact, dpre]);
            self.gpu_partials("ln2 parameter-gradient partials", 2 * c);
            let datt = self.alloc_act(format!("{b}.attn output gradient"), Kind::Transient, c);
            self.gpu_partials("attn.proj bias-gradient partials", c);
            let dqkv = self.alloc_act(format!("{b}.attn qkv gradient"), Kind::Transient, 3 * c);
            self.gpu_scratch("attention backward row sums", self.attn_stats_bytes());
            let d_ln1 = self.alloc_act(format!("{b}.ln1 output gradient"), Kind::Transient, c);
            self.gpu_partials("attn.qkv bias-gradient partials", 3 * c);
            self.w.free_all([datt, dqkv]);
            self.gpu_partials("ln1 parameter-gradient partials", 2 * c);
            self.w.free_all([d_ln1, d_ln2, block.input]);
            self.w.free_all(rest);
        }
        self.gpu_scratch("token ids", 4 * n);
        self.w.free(dstream);
        self.w.free_all(final_norm);
        // The optimizer step: the gradient norm's partials, then the in-place AdamW pass.
        self.gpu_scratch("gradient-norm partials", 8 * GPU_SUM_SQUARES_PARTIALS + 16);
    }

    /// Weights, gradients and optimizer state, per parameter tensor, as `Trainer::new`
    /// allocates them.
    fn persistent(&mut self) {
        let compute = self.s.layout.weights;
        if self.s.offload {
            return self.persistent_offloaded();
        }
        for (name, n) in param_shapes(self.cfg) {
            self.w.alloc(format!("{name} master"), Kind::Master, 4 * n);
            self.w.alloc(format!("{name} gradient"), Kind::Grad, 4 * n);
            if compute != DType::F32 {
                self.w.alloc(
                    format!("{name} compute copy"),
                    Kind::Compute,
                    compute.size_bytes() * n,
                );
            }
        }
        for (name, n) in param_shapes(self.cfg) {
            self.w
                .alloc(format!("{name} AdamW moments"), Kind::Optimizer, 8 * n);
        }
    }

    /// With the optimizer offloaded the model is still built on the device (master and
    /// gradient per parameter); then, one parameter at a time, its compute copy is made and
    /// its master leaves for the host. Under fp32 the master itself becomes the compute copy.
    fn persistent_offloaded(&mut self) {
        let compute = self.s.layout.weights;
        let shapes = param_shapes(self.cfg);
        let masters: Vec<_> = shapes
            .iter()
            .map(|(name, n)| {
                let m = self.w.alloc(format!("{name} master"), Kind::Master, 4 * n);
                self.w.alloc(format!("{name} gradient"), Kind::Grad, 4 * n);
                m
            })
            .collect();
        for ((name, n), master) in shapes.iter().zip(masters) {
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
    }
}

/// Walks one training step of `cfg` (whose `vocab` is the padded vocabulary the model is
/// built with).
pub fn walk_step(cfg: &GptConfig, s: StepSpec) -> Walk {
    let mut w = Walk::default();
    Step {
        w: &mut w,
        cfg,
        s,
        gpu: s.layout.device != Device::Cpu,
    }
    .run();
    w
}

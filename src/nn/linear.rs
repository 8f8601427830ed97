//! Fully connected layer, `y = x W^T + b`, weights stored `[out, in]`, optionally with
//! low-rank adapters on blocks of its output (see [`super::lora`]). A frozen weight skips its
//! weight-gradient GEMM, and may be kept only in NF4 (QLoRA): then each GEMM that reads it
//! first expands it into the model's shared [`DequantWorkspace`].

use super::lora::{self, Adapter, FoldedWeight, KeptSlot, LoraSpec, OutputBlock};
use super::{Cost, Init, Param, ParamBuilder, params};
use crate::engine::quant::{DequantWorkspace, Nf4Weight};
use crate::engine::{EngineError, GemmShape, MatrixView, Result, Tensor, ops};
use std::sync::Arc;

/// A frozen weight held only in NF4, and the workspace its GEMMs expand it into.
pub struct Nf4Frozen {
    pub weight: Nf4Weight,
    pub workspace: Arc<DequantWorkspace>,
}

pub struct Linear {
    /// The weight; when [`Linear::nf4`] holds it, an empty placeholder that keeps its name,
    /// frozen flag and compute dtype.
    pub weight: Param,
    /// The frozen weight in NF4, when the base is quantised (`lora.quantize = "nf4"`).
    pub nf4: Option<Nf4Frozen>,
    pub bias: Option<Param>,
    pub c_in: usize,
    pub c_out: usize,
    /// Named blocks of the output columns that adapters can target (set by the model;
    /// empty means the layer is not a target).
    pub blocks: Vec<OutputBlock>,
    pub adapters: Vec<Adapter>,
    /// What the adapters' forward keeps for their backward in a training pass.
    kept: KeptSlot,
    /// `[W | B]` when the adapters are folded into the product (see [`Linear::fold_width`]).
    folded: FoldedWeight,
}

params!(Linear {
    weight,
    bias,
    adapters
});

impl Linear {
    /// A layer named by `b`'s scope: its weight `[c_out, c_in]` normal with `std`, its bias
    /// zero.
    pub fn new(
        b: &mut ParamBuilder,
        c_in: usize,
        c_out: usize,
        bias: bool,
        std: f32,
    ) -> Result<Linear> {
        Ok(Linear {
            // Only this layer's backward writes the weight's gradient, through Param's
            // accessors: the trainer may leave its clear to the product.
            weight: b
                .param("weight", &[c_out, c_in], Init::Normal(std))?
                .with_lazy_grad(),
            bias: if bias {
                Some(b.param("bias", &[c_out], Init::Zeros)?)
            } else {
                None
            },
            nf4: None,
            c_in,
            c_out,
            blocks: Vec::new(),
            adapters: Vec::new(),
            kept: KeptSlot::default(),
            folded: FoldedWeight::default(),
        })
    }

    /// Names the output blocks (`(module, columns)` in column order) adapters may target.
    pub fn set_blocks(&mut self, blocks: &[(String, usize)]) {
        let mut col0 = 0;
        self.blocks = blocks
            .iter()
            .map(|(module, cols)| {
                let b = OutputBlock {
                    module: module.clone(),
                    col0,
                    cols: *cols,
                };
                col0 += cols;
                b
            })
            .collect();
        debug_assert_eq!(col0, self.c_out, "blocks must cover the output");
    }

    /// Freezes the weight and bias and adds an adapter on every block `spec` targets;
    /// returns the modules it adapted. The adapters are named in `b`'s scope, the layer's.
    pub fn attach_lora(&mut self, b: &mut ParamBuilder, spec: &LoraSpec) -> Result<Vec<String>> {
        self.freeze()?;
        let mut adapted = Vec::new();
        for block in self.blocks.iter().filter(|b| spec.matches(b)) {
            adapted.push(block.module.clone());
            self.adapters
                .push(Adapter::new(b, block.clone(), self.c_in, spec)?);
        }
        Ok(adapted)
    }

    /// Freezes the weight and the bias (no gradients, no weight-gradient GEMMs).
    pub fn freeze(&mut self) -> Result<()> {
        self.weight.freeze()?;
        if let Some(b) = &mut self.bias {
            b.freeze()?;
        }
        Ok(())
    }

    /// Replaces the frozen weight by its NF4 quantisation and frees the dense copy; its GEMMs
    /// will expand it into `workspace`. The values are `dense` (the host values of a weight
    /// loaded as a placeholder) or else the ones it holds now, so call it before they are
    /// rounded to a compute dtype. Returns the bytes the NF4 weight holds.
    pub fn quantize_nf4(
        &mut self,
        workspace: &Arc<DequantWorkspace>,
        dense: Option<&[f32]>,
    ) -> Result<usize> {
        if !self.weight.frozen {
            return Err(EngineError::Shape {
                op: "nf4 quantize",
                detail: format!(
                    "{} trains; only a frozen weight can be kept in NF4",
                    self.weight.name
                ),
            });
        }
        let pool = self.weight.value.pool().clone();
        let held;
        let values = match dense {
            Some(d) => d,
            None => {
                held = self.weight.value.to_vec()?;
                &held
            }
        };
        let weight = Nf4Weight::quantize(&pool, &self.weight.name, values, self.c_out, self.c_in)?;
        let bytes = weight.bytes();
        self.weight.value = Tensor::zeros(&pool, &[0], self.weight.value.dtype())?;
        self.weight.compute = None;
        self.nf4 = Some(Nf4Frozen {
            weight,
            workspace: workspace.clone(),
        });
        Ok(bytes)
    }

    /// Folds the adapters into the weight (f32 masters on the host side) and removes them; an
    /// NF4 weight is dequantised first and becomes a dense one again (with or without
    /// adapters), so merged models export and sample as dense weights.
    pub fn merge_adapters(&mut self) -> Result<()> {
        if self.adapters.is_empty() && self.nf4.is_none() {
            return Ok(());
        }
        let mut w = match self.nf4.take() {
            Some(q) => q.weight.to_host_f32()?,
            None => self.weight.value.to_vec()?,
        };
        for ad in &self.adapters {
            let delta = ad.delta()?;
            let rows =
                &mut w[ad.block.col0 * self.c_in..(ad.block.col0 + ad.block.cols) * self.c_in];
            rows.iter_mut().zip(&delta).for_each(|(w, d)| *w += d);
        }
        let value = &self.weight.value;
        self.weight.value =
            Tensor::from_vec(value.pool(), &[self.c_out, self.c_in], value.dtype(), w)?;
        self.weight.refresh_compute()?;
        self.adapters.clear();
        self.folded.clear();
        Ok(())
    }

    /// The columns by which this layer's input is widened when its adapters are folded into
    /// its product ([`lora::fold_width`]: a dense frozen weight without bias, an input width
    /// the widening keeps below the next power of two), else 0. The
    /// producer of the input (an RMSNorm) writes its rows that much wider, with zeros there,
    /// and [`Linear::fold_inputs`] fills them before the forward.
    pub fn fold_width(&self) -> usize {
        if self.bias.is_some() || self.nf4.is_some() || !self.weight.frozen {
            return 0;
        }
        lora::fold_width(&self.adapters, self.c_in)
    }

    /// Fills the extra columns of a widened input with the adapters' `scale * x A^T`; an
    /// input of the layer's own width (nothing folded) is left as it is.
    pub fn fold_inputs(&self, x: &mut Tensor) -> Result<()> {
        if !self.folded_input(x) {
            return Ok(());
        }
        lora::fold_inputs(&self.adapters, x)
    }

    /// Whether `x` is an input widened for the folded product.
    fn folded_input(&self, x: &Tensor) -> bool {
        let width = x.shape().last().copied().unwrap_or(0);
        width != self.c_in && width == self.c_in + self.fold_width()
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if self.folded_input(x) {
            // One product against [W | B]: x W^T + (scale x A^T) B^T.
            return self
                .folded
                .with(&self.adapters, self.weight.weight(), true, |w| {
                    ops::linear_forward(x, w, None)
                });
        }
        if self.bias.is_none() && lora::adapters_first(&self.adapters, self.c_in, self.c_out) {
            return self.forward_adapters_first(x);
        }
        let bias = self.bias.as_ref().map(Param::weight);
        let mut y = match &self.nf4 {
            Some(q) => q
                .workspace
                .with_weight(&q.weight, |w| ops::linear_forward(x, w, bias))?,
            None => ops::linear_forward(x, self.weight.weight(), bias)?,
        };
        lora::forward_layer(&self.adapters, &mut y, x, &self.kept, 1.0)?;
        Ok(y)
    }

    /// `y += x W^T` in place, the layer's product taking `y` as its accumulate input: a
    /// residual add without a kernel of its own (the Llama family's folded decode step). Plain
    /// layers only (no bias, adapters or 4-bit weight).
    pub fn forward_add(&self, x: &Tensor, y: &mut Tensor) -> Result<()> {
        if self.bias.is_some() || self.nf4.is_some() || !self.adapters.is_empty() {
            return Err(EngineError::Shape {
                op: "linear forward_add",
                detail: "only a plain weight adds its product into its output".into(),
            });
        }
        ops::linear_forward_add(x, self.weight.weight(), y)
    }

    /// [`Linear::forward`] with the adapters' outputs written first and the layer's product
    /// added into them by its GEMM (see [`lora::adapters_first`]).
    fn forward_adapters_first(&self, x: &Tensor) -> Result<Tensor> {
        let (rows, c_in) = ops::rows_cols("linear", x)?;
        let mut shape = x.shape().to_vec();
        *shape.last_mut().expect("rows_cols checked the rank") = self.c_out;
        let dtype = ops::activation_dtype(x.device(), x.dtype());
        let mut y = Tensor::uninit(x.pool(), &shape, dtype)?;
        lora::forward_layer(&self.adapters, &mut y, x, &self.kept, 0.0)?;
        let mut product = |w: &Tensor| {
            ops::matmul_view(
                GemmShape::single(false, true, rows, self.c_out, c_in),
                [
                    MatrixView::packed(c_in),
                    MatrixView::packed(c_in),
                    MatrixView::packed(self.c_out),
                ],
                1.0,
                x,
                w,
                1.0,
                &mut y,
            )
        };
        match &self.nf4 {
            Some(q) => q.workspace.with_weight(&q.weight, product)?,
            None => product(self.weight.weight())?,
        }
        Ok(y)
    }

    /// Returns `dx`; accumulates the parameter gradients. `x` is the forward's input.
    pub fn backward(&mut self, dout: &Tensor, x: &Tensor) -> Result<Tensor> {
        if self.folded_input(x) {
            // dY [W | B]: the input gradient (widened, as the input) with dY B after it.
            let mut dx = self
                .folded
                .with(&self.adapters, self.weight.weight(), false, |w| {
                    ops::linear_backward(dout, x, w, None, None)
                })?;
            lora::fold_backward(&mut self.adapters, dout, x, &mut dx)?;
            return Ok(dx);
        }
        if self.weight.frozen && self.bias.is_none() && lora::together(&self.adapters) {
            return self.backward_adapters_first(dout, x);
        }
        let db = match self.bias.as_mut() {
            Some(b) => b.grad_mut()?,
            None => None,
        };
        let mut dx = match &self.nf4 {
            // Frozen: the input gradient only, from the weight expanded once more.
            Some(q) => q
                .workspace
                .with_weight(&q.weight, |w| ops::linear_backward(dout, x, w, None, db))?,
            None => {
                let (w, dw) = self.weight.weight_and_grad_target();
                ops::linear_backward(dout, x, w, dw, db)?
            }
        };
        lora::backward_layer(&mut self.adapters, dout, x, &mut dx, &self.kept, 1.0)?;
        Ok(dx)
    }

    /// [`Linear::backward`] of a frozen layer whose adapters run together: their input
    /// gradient is written first and the frozen product's adds into it as its GEMM's
    /// `beta = 1` input (one write of `dx` instead of a second read and write).
    fn backward_adapters_first(&mut self, dout: &Tensor, x: &Tensor) -> Result<Tensor> {
        let (rows, c_in) = ops::rows_cols("linear backward", x)?;
        let dtype = ops::activation_dtype(dout.device(), dout.dtype());
        let mut dx = Tensor::uninit(x.pool(), x.shape(), dtype)?;
        lora::backward_layer(&mut self.adapters, dout, x, &mut dx, &self.kept, 0.0)?;
        let c_out = self.c_out;
        let mut product = |w: &Tensor| {
            ops::matmul_view(
                GemmShape::single(false, false, rows, c_in, c_out),
                [
                    MatrixView::packed(c_out),
                    MatrixView::packed(c_in),
                    MatrixView::packed(c_in),
                ],
                1.0,
                dout,
                w,
                1.0,
                &mut dx,
            )
        };
        match &self.nf4 {
            Some(q) => q.workspace.with_weight(&q.weight, product)?,
            None => product(self.weight.weight())?,
        }
        Ok(dx)
    }

    /// Whether the layer is its weight and bias alone (no 4-bit base, no adapters): the fused
    /// GELU products below take only such layers.
    fn plain(&self) -> bool {
        self.nf4.is_none() && self.adapters.is_empty()
    }

    /// `gelu(self.forward(x))` and the GELU's argument, `(pre, act)`: for a plain layer one
    /// product whose epilogue applies the GELU on the GPU ([`ops::linear_gelu_forward`]).
    pub fn forward_gelu(&self, x: &Tensor) -> Result<(Tensor, Tensor)> {
        if self.plain() {
            let bias = self.bias.as_ref().map(Param::weight);
            return ops::linear_gelu_forward(x, self.weight.weight(), bias);
        }
        let pre = self.forward(x)?;
        let act = ops::gelu_forward(&pre)?;
        Ok((pre, act))
    }

    /// The backward of `self.forward(act)` where `act = gelu(pre)`, carried through the GELU:
    /// returns the gradient of `pre` and accumulates the parameter gradients. For a plain
    /// layer the input gradient is one product whose epilogue applies the GELU's derivative on
    /// the GPU ([`ops::linear_gelu_backward`]).
    pub fn backward_gelu(&mut self, dout: &Tensor, act: &Tensor, pre: &Tensor) -> Result<Tensor> {
        if self.plain() {
            let db = match self.bias.as_mut() {
                Some(b) => b.grad_mut()?,
                None => None,
            };
            let (w, dw) = self.weight.weight_and_grad_target();
            return ops::linear_gelu_backward(dout, act, pre, w, dw, db);
        }
        let dact = self.backward(dout, act)?;
        ops::gelu_backward(pre, &dact)
    }

    pub fn cost(&self, tokens: usize) -> Cost {
        Self::cost_of(self.c_in, self.c_out, self.bias.is_some(), tokens)
    }

    /// The input is saved for the weight gradient; the layer that produced it counts those bytes.
    pub fn cost_of(c_in: usize, c_out: usize, bias: bool, tokens: usize) -> Cost {
        let mac = (tokens * c_in * c_out) as u64;
        Cost {
            params: c_in * c_out + if bias { c_out } else { 0 },
            flops_forward: 2 * mac,
            flops_backward: 4 * mac,
            saved_bytes: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::gradcheck::*;

    #[test]
    fn backward_matches_finite_differences() {
        let p = pool();
        let mut lin = build(&p, "fc", 1, |b| Linear::new(b, 6, 5, true, 0.5));
        lin.bias
            .as_mut()
            .unwrap()
            .value
            .copy_from_host(&random_tensor(&p, &[5], 9).to_vec().unwrap())
            .unwrap();
        let x = random_tensor(&p, &[2, 3, 6], 2);
        let w = random_tensor(&p, &[2, 3, 5], 3);
        let dx = lin.backward(&w, &x).unwrap();
        check("dx", &x, dx.host(), 100, |x| {
            weighted_sum(&lin.forward(x).unwrap(), &w)
        });
        let dw = lin.weight.grad.to_vec().unwrap();

        let weight = lin.weight.value.try_clone().unwrap();
        check("dW", &weight, &dw, 100, |wt| {
            weighted_sum(
                &ops::linear_forward(&x, wt, lin.bias.as_ref().map(|b| &b.value)).unwrap(),
                &w,
            )
        });
        let db = lin.bias.as_ref().unwrap().grad.to_vec().unwrap();
        let bias = lin.bias.as_ref().unwrap().value.try_clone().unwrap();
        check("db", &bias, &db, 100, |b| {
            weighted_sum(&ops::linear_forward(&x, &weight, Some(b)).unwrap(), &w)
        });
        assert_eq!(lin.cost(6).params, 35);
        assert_eq!(lin.cost(6).flops_forward, 2 * 6 * 30);
    }

    /// Adapter dropout: inside a training scope the input gradient still matches finite
    /// differences (the mask is fixed by the scope's seed), the output differs from the
    /// undropped one, and outside any scope nothing is dropped.
    #[test]
    fn adapter_dropout_has_exact_gradients_inside_a_scope_only() {
        let p = pool();
        let mut lin = build(&p, "qkv", 1, |b| Linear::new(b, 6, 4, false, 0.5));
        lin.set_blocks(&[("q".into(), 4)]);
        let spec = LoraSpec {
            dropout: 0.5,
            ..LoraSpec::plain(2, &["q"])
        };
        build(&p, "qkv", 2, |b| lin.attach_lora(b, &spec));
        let n = lin.adapters[0].b.value.len();
        let vals = random_tensor(&p, &[n], 10).to_vec().unwrap();
        lin.adapters[0].b.value.copy_from_host(&vals).unwrap();
        let x = random_tensor(&p, &[3, 6], 3);
        let w = random_tensor(&p, &[3, 4], 4);
        let plain = lin.forward(&x).unwrap().to_vec().unwrap();
        let _scope = super::super::lora::dropout_scope(99);
        let dropped = lin.forward(&x).unwrap().to_vec().unwrap();
        assert_ne!(plain, dropped, "the scope drops adapter inputs");
        let dx = lin.backward(&w, &x).unwrap();
        check("dx", &x, dx.host(), 100, |x| {
            weighted_sum(&lin.forward(x).unwrap(), &w)
        });
        drop(_scope);
        assert_eq!(lin.forward(&x).unwrap().to_vec().unwrap(), plain);
    }

    /// Adapters on two of three output blocks of a frozen layer: the input and adapter
    /// gradients match finite differences, the frozen weight gets no gradient, and merging
    /// gives the same outputs.
    #[test]
    fn adapters_on_blocks_of_a_frozen_layer() {
        let p = pool();
        let mut lin = build(&p, "qkv", 1, |b| Linear::new(b, 6, 7, true, 0.5));
        lin.set_blocks(&[("q".into(), 3), ("k".into(), 2), ("v".into(), 2)]);
        let spec = LoraSpec::plain(2, &["q", "v"]);
        let adapted = build(&p, "qkv", 2, |b| lin.attach_lora(b, &spec));
        assert_eq!(adapted, vec!["q".to_string(), "v".to_string()]);
        assert!(lin.weight.frozen && lin.weight.grad.is_empty());
        // B starts at zero; give it values so every path is exercised.
        for (i, ad) in lin.adapters.iter_mut().enumerate() {
            let n = ad.b.value.len();
            let vals = random_tensor(&p, &[n], 10 + i as u64).to_vec().unwrap();
            ad.b.value.copy_from_host(&vals).unwrap();
        }
        let x = random_tensor(&p, &[2, 3, 6], 3);
        let w = random_tensor(&p, &[2, 3, 7], 4);
        let dx = lin.backward(&w, &x).unwrap();
        check("dx", &x, dx.host(), 100, |x| {
            weighted_sum(&lin.forward(x).unwrap(), &w)
        });
        for k in 0..2 {
            let da = lin.adapters[k].a.grad.to_vec().unwrap();
            let a0 = lin.adapters[k].a.value.try_clone().unwrap();
            let mut probe = build(&p, "qkv", 1, |b| Linear::new(b, 6, 7, true, 0.5));
            probe.set_blocks(&[("q".into(), 3), ("k".into(), 2), ("v".into(), 2)]);
            build(&p, "qkv", 2, |b| probe.attach_lora(b, &spec));
            for (dst, src) in probe.adapters.iter_mut().zip(&lin.adapters) {
                dst.a
                    .value
                    .copy_from_host(&src.a.value.to_vec().unwrap())
                    .unwrap();
                dst.b
                    .value
                    .copy_from_host(&src.b.value.to_vec().unwrap())
                    .unwrap();
            }
            check("dA", &a0, &da, 100, |a| {
                probe.adapters[k]
                    .a
                    .value
                    .copy_from_host(&a.to_vec().unwrap())
                    .unwrap();
                weighted_sum(&probe.forward(&x).unwrap(), &w)
            });
        }
        let before = lin.forward(&x).unwrap().to_vec().unwrap();
        let mut merged = build(&p, "qkv", 1, |b| Linear::new(b, 6, 7, true, 0.5));
        merged.set_blocks(&[("q".into(), 3), ("k".into(), 2), ("v".into(), 2)]);
        merged.adapters = std::mem::take(&mut lin.adapters);
        merged.merge_adapters().unwrap();
        assert!(merged.adapters.is_empty());
        let after = merged.forward(&x).unwrap().to_vec().unwrap();
        for (a, b) in before.iter().zip(&after) {
            assert!((a - b).abs() < 1e-5, "merged {b} vs adapted {a}");
        }
    }

    /// A frozen q/k/v layer (3 + 2 + 2 outputs) over `c_in` inputs with `spec`'s adapters,
    /// their `B`s drawn from `seed` on (a fresh `B` is zero and would hide half the paths).
    fn qkv_with_adapters(
        p: &Arc<crate::engine::MemoryPool>,
        c_in: usize,
        bias: bool,
        spec: &LoraSpec,
        seed: u64,
    ) -> Linear {
        let mut lin = build(p, "qkv", 1, |b| Linear::new(b, c_in, 7, bias, 0.5));
        lin.set_blocks(&[("q".into(), 3), ("k".into(), 2), ("v".into(), 2)]);
        build(p, "qkv", 2, |b| lin.attach_lora(b, spec));
        for (i, ad) in lin.adapters.iter_mut().enumerate() {
            let vals = random_tensor(p, &[ad.b.value.len()], seed + i as u64);
            ad.b.value.copy_from_host(&vals.to_vec().unwrap()).unwrap();
        }
        lin
    }

    /// Every adapter's `A` and `B` gradients, in order.
    fn adapter_grads(lin: &Linear) -> Vec<Vec<f32>> {
        lin.adapters
            .iter()
            .flat_map(|ad| [ad.a.grad.to_vec().unwrap(), ad.b.grad.to_vec().unwrap()])
            .collect()
    }

    /// `a` within 1e-5 (relative, above 1) of `b`, element by element.
    fn assert_close(what: &str, a: &[f32], b: &[f32]) {
        assert_eq!(a.len(), b.len(), "{what}");
        for (x, y) in a.iter().zip(b) {
            assert!(
                (x - y).abs() <= 1e-5 * (1.0 + y.abs()),
                "{what}: {x} vs {y}"
            );
        }
    }

    /// A layer's adapters run together inside a training pass (one `x A^T` kept from the
    /// forward, one `A` gradient product, one input-gradient product): the outputs and every
    /// gradient equal those of the adapters run one by one outside a pass, and a backward
    /// without its forward (nothing kept) recomputes the same. Without a bias (and an output
    /// over twice the input's width) the adapters write the output first and the layer's
    /// product adds into it, and the backward does the same with the input gradient.
    #[test]
    fn adapters_run_together_in_a_training_pass() {
        // With a bias the layer's product runs first; without, the adapters do.
        for bias in [true, false] {
            adapters_together(bias);
        }
    }

    fn adapters_together(bias: bool) {
        let p = pool();
        let spec = LoraSpec::plain(2, &["all-linear"]);
        let layer = || qkv_with_adapters(&p, 3, bias, &spec, 10);
        let (grads, close) = (adapter_grads, assert_close);
        let x = random_tensor(&p, &[2, 3, 3], 3);
        let dy = random_tensor(&p, &[2, 3, 7], 4);
        let mut alone = layer();
        let y_alone = alone.forward(&x).unwrap().to_vec().unwrap();
        let dx_alone = alone.backward(&dy, &x).unwrap().to_vec().unwrap();
        let mut together = layer();
        let mut recomputed = layer();
        {
            let _pass = super::super::lora::dropout_scope(7);
            let y = together.forward(&x).unwrap().to_vec().unwrap();
            close("y", &y, &y_alone);
            let dx = together.backward(&dy, &x).unwrap().to_vec().unwrap();
            close("dx", &dx, &dx_alone);
            let dx = recomputed.backward(&dy, &x).unwrap().to_vec().unwrap();
            close("dx recomputed", &dx, &dx_alone);
        }
        for (g, want) in grads(&together).iter().zip(grads(&alone).iter()) {
            close("adapter gradient", g, want);
        }
        for (g, want) in grads(&recomputed).iter().zip(grads(&alone).iter()) {
            close("recomputed adapter gradient", g, want);
        }
        assert!(grads(&alone).iter().all(|g| g.iter().any(|v| *v != 0.0)));
    }

    /// Adapters folded into a frozen layer's product (ranks summing to a multiple of 8, no
    /// bias, in a training pass): the widened input's last columns hold `scale * x A^T`, and
    /// the output, the input gradient (the widened gradient's first columns) and every adapter
    /// gradient equal those of the adapters run apart outside a pass.
    #[test]
    fn folded_adapters_compute_what_they_compute_apart() {
        let p = pool();
        let spec = LoraSpec::plain(8, &["all-linear"]);
        let layer = || qkv_with_adapters(&p, 40, false, &spec, 30);
        let (grads, close) = (adapter_grads, assert_close);
        let x = random_tensor(&p, &[2, 3, 40], 7);
        let dy = random_tensor(&p, &[2, 3, 7], 8);
        let mut apart = layer();
        assert_eq!(
            apart.fold_width(),
            0,
            "outside a training pass nothing folds"
        );
        let y_apart = apart.forward(&x).unwrap().to_vec().unwrap();
        let dx_apart = apart.backward(&dy, &x).unwrap().to_vec().unwrap();
        let mut folded = layer();
        let _pass = super::super::lora::dropout_scope(3);
        let wider = qkv_with_adapters(&p, 48, false, &spec, 30);
        assert_eq!(wider.fold_width(), 0, "48 + 24 passes 64: kept apart");
        let r = folded.fold_width();
        assert_eq!(r, 24, "three adapters of rank 8");
        // The widened input as its norm leaves it: x, then zeros.
        let wide: Vec<f32> = x
            .to_vec()
            .unwrap()
            .chunks(40)
            .flat_map(|row| row.iter().copied().chain(std::iter::repeat_n(0.0, r)))
            .collect();
        let mut xw = Tensor::from_vec(&p, &[2, 3, 40 + r], x.dtype(), wide).unwrap();
        folded.fold_inputs(&mut xw).unwrap();
        let y = folded.forward(&xw).unwrap().to_vec().unwrap();
        close("y", &y, &y_apart);
        let dxw = folded.backward(&dy, &xw).unwrap();
        assert_eq!(dxw.shape(), &[2, 3, 40 + r]);
        let dx: Vec<f32> = dxw
            .to_vec()
            .unwrap()
            .chunks(40 + r)
            .flat_map(|row| row[..40].to_vec())
            .collect();
        close("dx", &dx, &dx_apart);
        for (g, want) in grads(&folded).iter().zip(grads(&apart).iter()) {
            close("adapter gradient", g, want);
        }
        assert!(grads(&apart).iter().all(|g| g.iter().any(|v| *v != 0.0)));
    }

    /// Adapter gradients are cleared by their first write of a step: after a deferred clear
    /// the next backward leaves exactly its own gradients (not the stale ones plus them), a
    /// second backward then adds to them, alone and with the adapters run together.
    #[test]
    fn adapter_gradients_are_cleared_by_their_first_write() {
        let p = pool();
        let spec = LoraSpec::plain(2, &["all-linear"]);
        for together in [false, true] {
            let mut lin = qkv_with_adapters(&p, 3, false, &spec, 20);
            let x = random_tensor(&p, &[2, 3, 3], 5);
            let dy = random_tensor(&p, &[2, 3, 7], 6);
            let grads = adapter_grads;
            let backward = |lin: &mut Linear, pass: u64| {
                let _pass = together.then(|| super::super::lora::dropout_scope(pass));
                if together {
                    lin.forward(&x).unwrap();
                }
                lin.backward(&dy, &x).unwrap();
            };
            backward(&mut lin, 1);
            let once = grads(&lin);
            assert!(once.iter().all(|g| g.iter().any(|v| *v != 0.0)));
            for ad in lin.adapters.iter_mut() {
                ad.a.defer_grad_clear().unwrap();
                ad.b.defer_grad_clear().unwrap();
            }
            assert_eq!(grads(&lin), once, "the clear waits for the first write");
            backward(&mut lin, 2);
            assert_eq!(grads(&lin), once, "together {together}: a cleared step");
            backward(&mut lin, 3);
            for (g, o) in grads(&lin).iter().zip(&once) {
                let doubled: Vec<f32> = o.iter().map(|v| v + v).collect();
                assert_eq!(g, &doubled, "together {together}: a second pass adds");
            }
        }
    }

    /// An NF4 frozen layer computes exactly what a dense layer whose weight is the
    /// dequantised NF4 weight computes (bit for bit on the CPU), forward and backward; its
    /// dense copy is freed; merging makes it dense again, adapters included.
    #[test]
    fn an_nf4_weight_computes_as_its_dequantised_dense_weight() {
        use crate::engine::DType;
        let p = pool();
        let mut lin = build(&p, "up", 1, |b| Linear::new(b, 48, 40, true, 0.5));
        lin.set_blocks(&[("up_proj".into(), 40)]);
        let spec = LoraSpec::plain(2, &["up_proj"]);
        let fresh = build(&p, "up", 1, |b| Linear::new(b, 48, 40, true, 0.5));
        let e = {
            let mut trainable = fresh;
            let ws = Arc::new(DequantWorkspace::new(&p, 48 * 40, DType::F32).unwrap());
            trainable.quantize_nf4(&ws, None).unwrap_err().to_string()
        };
        assert!(e.contains("up.weight trains"), "{e}");
        build(&p, "up", 2, |b| lin.attach_lora(b, &spec));
        let b_vals = random_tensor(&p, &[40 * 2], 5).to_vec().unwrap();
        lin.adapters[0].b.value.copy_from_host(&b_vals).unwrap();
        let dense_before = lin.weight.value.bytes();
        let ws = Arc::new(DequantWorkspace::new(&p, 48 * 40, DType::F32).unwrap());
        let before = p.stats().current;
        let nf4_bytes = lin.quantize_nf4(&ws, None).unwrap();
        assert_eq!(lin.weight.value.len(), 0, "the dense copy is freed");
        assert_eq!(
            p.stats().current + dense_before,
            before + nf4_bytes,
            "the pool books the NF4 bytes in place of the dense weight"
        );
        let deq = lin
            .nf4
            .as_ref()
            .unwrap()
            .weight
            .dequantize(DType::F32)
            .unwrap();
        let x = random_tensor(&p, &[3, 5, 48], 3);
        let dy = random_tensor(&p, &[3, 5, 40], 4);
        let bias = lin.bias.as_ref().map(|b| &b.value);
        // The dense twin: the same layer with the dequantised weight.
        let mut twin = build(&p, "up", 1, |b| Linear::new(b, 48, 40, true, 0.5));
        twin.set_blocks(&[("up_proj".into(), 40)]);
        build(&p, "up", 2, |b| twin.attach_lora(b, &spec));
        twin.adapters[0].b.value.copy_from_host(&b_vals).unwrap();
        twin.weight.value = deq.try_clone().unwrap();
        let y = lin.forward(&x).unwrap().to_vec().unwrap();
        assert_eq!(y, twin.forward(&x).unwrap().to_vec().unwrap());
        let plain = ops::linear_forward(&x, &deq, bias)
            .unwrap()
            .to_vec()
            .unwrap();
        assert_ne!(y, plain, "the adapter contributes");
        let dx = lin.backward(&dy, &x).unwrap().to_vec().unwrap();
        assert_eq!(dx, twin.backward(&dy, &x).unwrap().to_vec().unwrap());
        assert_eq!(
            lin.adapters[0].a.grad.to_vec().unwrap(),
            twin.adapters[0].a.grad.to_vec().unwrap()
        );
        // Merged: dense again, the dequantised weight plus the adapter's delta.
        lin.merge_adapters().unwrap();
        twin.merge_adapters().unwrap();
        assert!(lin.nf4.is_none() && lin.adapters.is_empty());
        assert_eq!(lin.weight.value.shape(), &[40, 48]);
        assert_eq!(
            lin.weight.value.to_vec().unwrap(),
            twin.weight.value.to_vec().unwrap()
        );
    }
}

//! Mixture-of-experts feed-forward: a router sends each token to `top_k` of `experts` MLPs,
//! and the token's output is the sum of those experts' outputs, each weighted by the router's
//! softmax probability for it (the gate).
//!
//! Because the gates multiply the outputs, the router learns from the main loss (a hard
//! argmax would give it no gradient). A Switch-style load-balancing loss,
//! `E * sum_e f_e * P_e` with `f_e` the share of top-k choices that went to expert `e` and
//! `P_e` its mean router probability, pushes the router towards even use; its gradient reaches
//! the router through `P_e`. Each expert takes at most `ceil(capacity_factor * k * T / E)`
//! token slots per batch of `T` tokens; first choices are served before second choices, and
//! within a rank earlier tokens first. A slot over capacity is dropped (the token gets nothing
//! from that expert; the residual stream carries it on) and counted in [`MoeStats`].
//!
//! Routing is decided on the host from the downloaded router logits (`T x E`, small), with
//! ties broken towards the lower expert index, so it is deterministic. The heavy work (packing
//! each expert's rows, the expert GEMMs, the weighted scatter back, and their backward) runs
//! on the tensors' device through `engine::ops`.

use super::linear::Linear;
use super::mlp::{Mlp, MlpSaved};
use super::{Cost, ParamBuilder, f32_bytes, params};
use crate::engine::{Result, Tensor, ops};

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MoeConfig {
    pub d_model: usize,
    /// Width of each expert's hidden layer.
    pub hidden: usize,
    pub experts: usize,
    /// Experts per token: 1 (Switch) or 2.
    pub top_k: usize,
    pub capacity_factor: f64,
    /// Weight of the load-balancing loss in the training objective.
    pub aux_coef: f64,
}

impl MoeConfig {
    /// Token slots one expert processes at most in a batch of `tokens` tokens.
    pub fn capacity(&self, tokens: usize) -> usize {
        (self.capacity_factor * (self.top_k * tokens) as f64 / self.experts as f64).ceil() as usize
    }
}

/// The tokens one expert processes, in the order it took them, and their gate weights.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ExpertSlots {
    pub tokens: Vec<u32>,
    pub gates: Vec<f32>,
}

/// Where every token goes, decided on the host.
#[derive(Debug, Clone)]
pub struct Routing {
    pub tokens: usize,
    pub experts: usize,
    pub top_k: usize,
    /// Router softmax `[tokens, experts]`, in f64 (its gradient is formed here too).
    pub probs: Vec<f64>,
    pub slots: Vec<ExpertSlots>,
    /// Top-k choices per expert before the capacity cut (what `f_e` counts).
    pub chosen: Vec<usize>,
    pub dropped: usize,
}

/// The most token slots each expert of one layer can hold for `tokens` tokens: every slot
/// kept and the experts filled in turn, each to its capacity (and to one slot per token,
/// since a token picks an expert at most once). No routing allocates more, in total or in
/// any one expert.
pub fn worst_case_loads(
    tokens: usize,
    experts: usize,
    top_k: usize,
    capacity: usize,
) -> Vec<usize> {
    let per_expert = capacity.min(tokens);
    let mut left = top_k * tokens;
    (0..experts)
        .map(|_| {
            let take = left.min(per_expert);
            left -= take;
            take
        })
        .collect()
}

impl Routing {
    /// Routes `tokens` rows of router `logits` (`[tokens, experts]`) to their `top_k` most
    /// probable experts, at most `capacity` slots per expert.
    pub fn new(
        logits: &[f32],
        tokens: usize,
        experts: usize,
        top_k: usize,
        capacity: usize,
    ) -> Routing {
        let mut probs = vec![0.0f64; tokens * experts];
        for (p, l) in probs.chunks_mut(experts).zip(logits.chunks(experts)) {
            let max = l.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) as f64;
            for (p, &x) in p.iter_mut().zip(l) {
                *p = (x as f64 - max).exp();
            }
            let sum: f64 = p.iter().sum();
            p.iter_mut().for_each(|p| *p /= sum);
        }
        // Each token's experts by falling probability, ties to the lower index.
        let choices: Vec<Vec<usize>> = probs
            .chunks(experts)
            .map(|p| {
                let mut order: Vec<usize> = (0..experts).collect();
                order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
                order.truncate(top_k);
                order
            })
            .collect();
        let mut slots = vec![ExpertSlots::default(); experts];
        let mut chosen = vec![0; experts];
        let mut dropped = 0;
        for rank in 0..top_k {
            for (t, c) in choices.iter().enumerate() {
                let e = c[rank];
                chosen[e] += 1;
                if slots[e].tokens.len() < capacity {
                    slots[e].tokens.push(t as u32);
                    slots[e].gates.push(probs[t * experts + e] as f32);
                } else {
                    dropped += 1;
                }
            }
        }
        Routing {
            tokens,
            experts,
            top_k,
            probs,
            slots,
            chosen,
            dropped,
        }
    }

    /// The routing that books the most memory, for a meta device (which has no logits to
    /// route by): experts filled in turn, each to its capacity ([`worst_case_loads`]).
    pub fn worst_case(tokens: usize, experts: usize, top_k: usize, capacity: usize) -> Routing {
        let loads = worst_case_loads(tokens, experts, top_k, capacity);
        let slots = loads
            .iter()
            .map(|&n| ExpertSlots {
                tokens: (0..n as u32).collect(),
                gates: vec![0.0; n],
            })
            .collect();
        Routing {
            tokens,
            experts,
            top_k,
            probs: vec![1.0 / experts as f64; tokens * experts],
            slots,
            chosen: loads,
            dropped: 0,
        }
    }

    /// `f_e`: the share of all top-k choices that went to expert `e`.
    fn choice_share(&self, e: usize) -> f64 {
        self.chosen[e] as f64 / (self.top_k * self.tokens) as f64
    }

    /// The load-balancing loss `E * sum_e f_e * P_e` (1 when routing is perfectly even).
    pub fn aux_loss(&self) -> f64 {
        let t = self.tokens as f64;
        (0..self.experts)
            .map(|e| {
                let mean_p: f64 = self.probs[e..].iter().step_by(self.experts).sum::<f64>() / t;
                self.choice_share(e) * mean_p
            })
            .sum::<f64>()
            * self.experts as f64
    }
}

/// What one forward did with its tokens.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MoeStats {
    /// Token slots asked for (`top_k` per token).
    pub slots: usize,
    /// Slots dropped because their expert was full.
    pub dropped: usize,
    /// Slots each expert processed.
    pub load: Vec<usize>,
    /// The load-balancing loss, before its coefficient.
    pub aux_loss: f64,
}

struct ExpertActs {
    input: Tensor,
    mlp: MlpSaved,
    output: Tensor,
}

/// What the backward needs: the routing, and per expert (if it had tokens) its packed input,
/// its MLP activations and its output (for the gate gradients).
pub struct MoeSaved {
    pub routing: Routing,
    experts: Vec<Option<ExpertActs>>,
}

impl MoeSaved {
    pub fn stats(&self) -> MoeStats {
        let r = &self.routing;
        MoeStats {
            slots: r.top_k * r.tokens,
            dropped: r.dropped,
            load: r.slots.iter().map(|s| s.tokens.len()).collect(),
            aux_loss: r.aux_loss(),
        }
    }
}

pub struct Moe {
    pub cfg: MoeConfig,
    pub router: Linear,
    pub experts: Vec<Mlp>,
}

params!(Moe { router, experts });

impl Moe {
    pub fn new(b: &mut ParamBuilder, cfg: MoeConfig, proj_std: f32) -> Result<Moe> {
        let router = Linear::new(
            &mut b.scope("router"),
            cfg.d_model,
            cfg.experts,
            false,
            0.02,
        )?;
        let experts = (0..cfg.experts)
            .map(|e| {
                let mut expert = b.scope(format_args!("experts.{e}"));
                Mlp::with_hidden(&mut expert, cfg.d_model, cfg.hidden, proj_std)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Moe {
            cfg,
            router,
            experts,
        })
    }

    /// `x[.., d_model]` -> the same shape, and what the backward needs (its `stats()` say
    /// how the tokens were routed).
    pub fn forward(&self, x: &Tensor) -> Result<(Tensor, MoeSaved)> {
        let logits = self.router.forward(x)?;
        let tokens = x.len() / self.cfg.d_model;
        let (experts, top_k, capacity) =
            (self.cfg.experts, self.cfg.top_k, self.cfg.capacity(tokens));
        // Routing depends on the data; a meta device plans its worst case.
        let routing = if x.is_meta() {
            Routing::worst_case(tokens, experts, top_k, capacity)
        } else {
            Routing::new(&logits.to_vec()?, tokens, experts, top_k, capacity)
        };
        drop(logits);
        let mut out = Tensor::zeros(x.pool(), x.shape(), x.dtype())?;
        let mut acts = Vec::with_capacity(self.experts.len());
        for (expert, slots) in self.experts.iter().zip(&routing.slots) {
            if slots.tokens.is_empty() {
                acts.push(None);
                continue;
            }
            let input = ops::gather_rows(x, &slots.tokens, None)?;
            let (output, mlp) = expert.forward(&input)?;
            ops::scatter_add_rows(&mut out, &output, &slots.tokens, Some(&slots.gates))?;
            acts.push(Some(ExpertActs { input, mlp, output }));
        }
        Ok((
            out,
            MoeSaved {
                routing,
                experts: acts,
            },
        ))
    }

    /// Returns `dx` for the objective `sum(out * dout) + aux_scale * aux_coef * aux_loss`;
    /// accumulates the parameter gradients. `x` is the forward's input.
    pub fn backward(
        &mut self,
        dout: &Tensor,
        x: &Tensor,
        saved: &MoeSaved,
        aux_scale: f32,
    ) -> Result<Tensor> {
        let r = &saved.routing;
        let (t, e_count) = (r.tokens, r.experts);
        // d objective / d router probabilities: through the gates, then the aux loss.
        let mut dprobs = vec![0.0f64; t * e_count];
        for (e, (acts, slots)) in saved.experts.iter().zip(&r.slots).enumerate() {
            if let Some(a) = acts {
                let dgates = ops::gathered_row_dot(dout, &slots.tokens, &a.output)?;
                for (&tok, &dg) in slots.tokens.iter().zip(&dgates) {
                    dprobs[tok as usize * e_count + e] += dg as f64;
                }
            }
        }
        let aux = aux_scale as f64 * self.cfg.aux_coef * e_count as f64 / t as f64;
        for e in 0..e_count {
            let d = aux * r.choice_share(e);
            dprobs[e..]
                .iter_mut()
                .step_by(e_count)
                .for_each(|g| *g += d);
        }
        // Softmax backward per token: dl_j = p_j * (dp_j - sum_i p_i dp_i).
        let mut dlogits = vec![0.0f32; t * e_count];
        for ((dl, p), dp) in dlogits
            .chunks_mut(e_count)
            .zip(r.probs.chunks(e_count))
            .zip(dprobs.chunks(e_count))
        {
            let dot: f64 = p.iter().zip(dp).map(|(a, b)| a * b).sum();
            for ((dl, p), dp) in dl.iter_mut().zip(p).zip(dp) {
                *dl = (p * (dp - dot)) as f32;
            }
        }
        let dlogits = Tensor::from_vec(x.pool(), &[t, e_count], x.dtype(), dlogits)?;
        let mut dx = self.router.backward(&dlogits, x)?;
        drop(dlogits);
        for ((expert, acts), slots) in self.experts.iter_mut().zip(&saved.experts).zip(&r.slots) {
            if let Some(a) = acts {
                let doutput = ops::gather_rows(dout, &slots.tokens, Some(&slots.gates))?;
                let dinput = expert.backward(&doutput, &a.input, &a.mlp)?;
                ops::scatter_add_rows(&mut dx, &dinput, &slots.tokens, None)?;
            }
        }
        Ok(dx)
    }

    /// Counted as if no slot were dropped: `top_k` expert passes per token.
    pub fn cost(&self, tokens: usize) -> Cost {
        Self::cost_of(&self.cfg, tokens)
    }

    /// [`Moe::cost`] from the configuration alone (for the planner).
    pub fn cost_of(cfg: &MoeConfig, tokens: usize) -> Cost {
        let slots = cfg.top_k * tokens;
        let one = Mlp::cost_of(cfg.d_model, cfg.hidden, slots, super::ActLayout::CPU_F32);
        let moved = (slots * cfg.d_model) as u64;
        let routing = Cost {
            params: (cfg.experts - 1) * one.params,
            // Gather, scaled scatter; backward: scaled gather, gate dots, scatter.
            flops_forward: 2 * moved,
            flops_backward: 4 * moved,
            // Each expert's packed input and its output.
            saved_bytes: f32_bytes(2 * slots * cfg.d_model),
        };
        Linear::cost_of(cfg.d_model, cfg.experts, false, tokens) + one + routing
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::gradcheck::*;

    fn cfg(top_k: usize, capacity_factor: f64) -> MoeConfig {
        MoeConfig {
            d_model: 6,
            hidden: 5,
            experts: 3,
            top_k,
            capacity_factor,
            aux_coef: 0.5,
        }
    }

    #[test]
    fn capacity_drops_the_latest_slots_and_counts_them() {
        // Top-1 over 2 experts, capacity ceil(1.0 * 6 / 2) = 3: five tokens prefer expert 0,
        // so tokens 0, 1, 2 get it and 4, 5 are dropped; token 3 goes to expert 1.
        let logits = [
            2.0, 0.0, 1.0, 0.0, 3.0, 1.0, 0.0, 5.0, 1.0, -1.0, 4.0, 2.0f32,
        ];
        let r = Routing::new(&logits, 6, 2, 1, 3);
        assert_eq!(r.slots[0].tokens, [0, 1, 2]);
        assert_eq!(r.slots[1].tokens, [3]);
        assert_eq!((r.dropped, r.chosen.clone()), (2, vec![5, 1]));
        let p0 = 1.0 / (1.0 + (-2.0f64).exp());
        assert!((r.slots[0].gates[0] as f64 - p0).abs() < 1e-7);

        // Top-2 over 3 experts, capacity ceil(2 * 4 / 3) = 3: first choices are served
        // before second choices. All four tokens first-choose expert 0, so token 3's first
        // choice is dropped; tokens 0, 1, 2 second-choose expert 1 and token 3 expert 2.
        let logits = [
            3.0, 1.0, 0.0, //
            3.0, 2.0, 1.0, //
            3.0, 1.0, 1.0, // a tie between experts 1 and 2: the lower index wins
            3.0, 0.0, 2.0f32,
        ];
        let r = Routing::new(&logits, 4, 3, 2, 3);
        assert_eq!(r.slots[0].tokens, [0, 1, 2]);
        assert_eq!(r.slots[1].tokens, [0, 1, 2]);
        assert_eq!(r.slots[2].tokens, [3]);
        assert_eq!((r.dropped, r.chosen.clone()), (1, vec![4, 3, 1]));

        let moe = build(&pool(), "moe", 1, |b| Moe::new(b, cfg(2, 1.0), 0.1));
        let (_, saved) = moe.forward(&random_tensor(&pool(), &[4, 6], 2)).unwrap();
        let stats = saved.stats();
        assert_eq!(stats.slots, 8);
        assert_eq!(stats.load.iter().sum::<usize>() + stats.dropped, 8);
        assert!(stats.load.iter().all(|&l| l <= moe.cfg.capacity(4)));
    }

    #[test]
    fn aux_loss_is_one_when_routing_is_even() {
        // Equal probabilities and equal choice shares: E * sum (1/E)(1/E) = 1.
        let logits = [1.0, 1.0, 1.0, 1.0f32];
        let r = Routing::new(&logits, 2, 2, 1, 2);
        assert_eq!(r.chosen, [2, 0]); // ties go to expert 0
        assert!((r.aux_loss() - 1.0).abs() < 1e-12);
        let logits = [0.0, 9.0, 9.0, 0.0f32];
        let r = Routing::new(&logits, 2, 2, 1, 2);
        assert_eq!(r.chosen, [1, 1]);
        assert!((r.aux_loss() - 1.0).abs() < 1e-12);
    }

    /// Objective `sum(out * w) + aux_scale * aux_coef * aux_loss`, in f64.
    fn objective(moe: &Moe, x: &Tensor, w: &Tensor, aux_scale: f64) -> (f64, Vec<ExpertSlots>) {
        let (out, saved) = moe.forward(x).unwrap();
        let loss = weighted_sum(&out, w) + aux_scale * moe.cfg.aux_coef * saved.routing.aux_loss();
        (loss, saved.routing.slots)
    }

    /// Central differences of the objective along every sampled element of `target` (a
    /// parameter or the input), skipping elements whose nudge changes the routing (there the
    /// objective jumps). Returns how many were compared.
    fn check_along(
        name: &str,
        analytic: &[f32],
        len: usize,
        mut eval: impl FnMut(usize, f32) -> (f64, Vec<ExpertSlots>),
        base: &[ExpertSlots],
    ) -> usize {
        let h = 1e-2f32;
        let mut compared = 0;
        for i in (0..len).step_by(len.div_ceil(40)) {
            let (plus, r1) = eval(i, h);
            let (minus, r2) = eval(i, -h);
            let same = |r: &[ExpertSlots]| r.iter().zip(base).all(|(a, b)| a.tokens == b.tokens);
            if !same(&r1) || !same(&r2) {
                continue;
            }
            let fd = ((plus - minus) / (2.0 * h as f64)) as f32;
            // f32 forward, h = 1e-2: rounding leaves about 1e-4 of absolute noise.
            assert!(
                (analytic[i] - fd).abs() < 1e-3 + 1e-2 * fd.abs(),
                "{name}[{i}]: analytic {} vs {fd}",
                analytic[i]
            );
            compared += 1;
        }
        compared
    }

    #[test]
    fn backward_matches_finite_differences_with_top1_and_top2() {
        for (top_k, capacity_factor) in [(1, 1.0), (2, 0.75), (2, 2.0)] {
            let p = pool();
            let mut moe = build(&p, "moe", 7, |b| {
                Moe::new(b, cfg(top_k, capacity_factor), 1.0)
            });
            // A sharp router, so that the small nudges below rarely change the routing.
            let sharp = random_tensor(&p, &[3, 6], 11).to_vec().unwrap();
            moe.router.weight.value.copy_from_host(&sharp).unwrap();
            let x = random_tensor(&p, &[2, 5, 6], 12);
            let w = random_tensor(&p, &[2, 5, 6], 13);
            let aux_scale = 3.0;
            let (_, saved) = moe.forward(&x).unwrap();
            let stats = saved.stats();
            if capacity_factor < 1.0 {
                assert!(stats.dropped > 0, "the test should exercise dropping");
            }
            let dx = moe.backward(&w, &x, &saved, aux_scale as f32).unwrap();
            let base = saved.routing.slots.clone();

            let dx = dx.to_vec().unwrap();
            let mut xs = x.to_vec().unwrap();
            let n = check_along(
                "dx",
                &dx,
                xs.len(),
                |i, d| {
                    xs[i] += d;
                    let xt = Tensor::from_vec(&p, x.shape(), x.dtype(), xs.clone()).unwrap();
                    xs[i] -= d;
                    objective(&moe, &xt, &w, aux_scale)
                },
                &base,
            );
            assert!(n >= 20, "top-{top_k}: only {n} input elements compared");

            let grads: Vec<Vec<f32>> = moe
                .params()
                .iter()
                .map(|q| q.grad.to_vec().unwrap())
                .collect();
            // Router, then every expert's four tensors.
            for (pi, g) in grads.iter().enumerate() {
                let compared = check_along(
                    &moe.params()[pi].name.clone(),
                    g,
                    g.len(),
                    |i, d| {
                        moe.params_mut()[pi].value.host_mut()[i] += d;
                        let r = objective(&moe, &x, &w, aux_scale);
                        moe.params_mut()[pi].value.host_mut()[i] -= d;
                        r
                    },
                    &base,
                );
                let name = &moe.params()[pi].name;
                // An expert that got no token has no gradient to compare.
                let expert = name
                    .strip_prefix("moe.experts.")
                    .and_then(|s| s.split('.').next())
                    .and_then(|s| s.parse::<usize>().ok());
                let used = expert.is_none_or(|e| !base[e].tokens.is_empty());
                assert!(
                    compared > 0 || !used,
                    "top-{top_k}: nothing of {name} compared"
                );
            }
        }
    }

    #[test]
    fn cost_counts_every_parameter() {
        let moe = build(&pool(), "moe", 1, |b| Moe::new(b, cfg(2, 1.25), 0.1));
        let n: usize = moe.params().iter().map(|p| p.value.len()).sum();
        assert_eq!(moe.cost(10).params, n);
        assert_eq!(n, 6 * 3 + 3 * (6 * 5 + 5 + 5 * 6 + 6));
    }
}

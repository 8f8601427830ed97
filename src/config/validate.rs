//! Range and consistency checks on a decoded [`Config`].
//!
//! These run after all layers are merged, because several rules relate two
//! keys (`train.seq_len` vs `model.context`) that may come from different
//! layers; checking a layer on its own would reject valid combinations.

use super::{Config, ConfigError};

pub(crate) const TOKENIZERS: &[&str] = &["byte", "gpt2"];
pub(crate) const RECOMPUTE: &[&str] = &["none", "blocks", "auto"];
pub(crate) const PRECISIONS: &[&str] = &["fp32", "tf32", "bf16-mixed", "fp16-mixed"];

pub(crate) fn out_of_range(
    key: &'static str,
    value: impl ToString,
    rule: impl Into<String>,
) -> ConfigError {
    ConfigError::OutOfRange {
        key,
        value: value.to_string(),
        rule: rule.into(),
    }
}

pub(crate) fn at_least_one(key: &'static str, value: usize) -> Result<(), ConfigError> {
    if value >= 1 {
        Ok(())
    } else {
        Err(out_of_range(key, value, "it must be at least 1"))
    }
}

/// Refuses the first NaN or infinite value of `values`, before any comparison would quietly
/// pass or fail it for the wrong reason.
pub(crate) fn finite(values: &[(&'static str, f64)]) -> Result<(), ConfigError> {
    match values.iter().find(|(_, v)| !v.is_finite()) {
        Some(&(key, value)) => Err(ConfigError::NotFinite { key, value }),
        None => Ok(()),
    }
}

fn one_of(key: &'static str, value: &str, allowed: &[&str]) -> Result<(), ConfigError> {
    if allowed.contains(&value) {
        Ok(())
    } else {
        Err(ConfigError::NotAllowed {
            key,
            value: value.to_string(),
            allowed: allowed.join(", "),
        })
    }
}

/// `auto`, `cpu`, `cuda`, or `cuda:N` with N a GPU index.
fn is_device(s: &str) -> bool {
    match s {
        "auto" | "cpu" | "cuda" => true,
        _ => s.strip_prefix("cuda:").is_some_and(|n| {
            !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) && n.parse::<usize>().is_ok()
        }),
    }
}

fn is_power_of_two(x: f64) -> bool {
    if !(x > 0.0 && x.is_finite()) {
        return false;
    }
    let exp = x.log2().round();
    // powi needs an i32; beyond that range no f64 is a finite power of two.
    (-1100.0..=1100.0).contains(&exp) && 2f64.powi(exp as i32) == x
}

/// Parses a byte count such as "12GiB", "800MB", "1.5 GiB" or "4096"; empty means no limit.
pub fn parse_bytes(text: &str) -> Result<Option<usize>, String> {
    let t = text.trim();
    if t.is_empty() {
        return Ok(None);
    }
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = (t[..split].trim(), t[split..].trim());
    let scale: f64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        _ => {
            return Err(format!(
                "unknown unit '{unit}'; use B, KB, MB, GB, KiB, MiB or GiB, e.g. \"12GiB\""
            ));
        }
    };
    match num.parse::<f64>() {
        Ok(n) if n > 0.0 && n.is_finite() => Ok(Some((n * scale) as usize)),
        _ => Err(
            "it must be a positive size such as \"12GiB\" or \"800MB\", or empty for no limit"
                .into(),
        ),
    }
}

impl Config {
    /// Checks every range and cross-key rule; the error names the key and the fix.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let (m, d, t, o) = (&self.model, &self.data, &self.train, &self.optim);

        finite(&[
            ("data.val_fraction", d.val_fraction),
            ("train.loss_scale_init", t.loss_scale_init),
            ("train.early_stop_min_delta", t.early_stop_min_delta),
            ("train.epochs", t.epochs),
            ("optim.lr", o.lr),
            ("optim.min_lr", o.min_lr),
            ("optim.weight_decay", o.weight_decay),
            ("optim.beta1", o.beta1),
            ("optim.beta2", o.beta2),
            ("optim.eps", o.eps),
            ("optim.grad_clip", o.grad_clip),
        ])?;

        at_least_one("model.d_model", m.d_model)?;
        at_least_one("model.n_layers", m.n_layers)?;
        at_least_one("model.n_heads", m.n_heads)?;
        at_least_one("model.context", m.context)?;
        let family = m.entry();
        if !m.preset.is_empty() && !family.presets.iter().any(|p| p.name == m.preset) {
            return Err(super::presets::unknown(family.kind, &m.preset));
        }
        (family.validate)(m)?;

        if !crate::data::is_tokenizer_path(&d.tokenizer) {
            one_of("data.tokenizer", &d.tokenizer, TOKENIZERS)?;
        }
        if !(d.val_fraction > 0.0 && d.val_fraction < 0.5) {
            return Err(out_of_range(
                "data.val_fraction",
                d.val_fraction,
                "it must be greater than 0 and less than 0.5, e.g. 0.05",
            ));
        }
        at_least_one("data.prefetch", d.prefetch)?;
        one_of(
            "data.format",
            &d.format,
            &["text", "prompt_completion", "chat", "alpaca"],
        )?;
        one_of(
            "optim.schedule",
            &o.schedule,
            &crate::optim::schedule::ScheduleShape::NAMES,
        )?;
        self.validate_lora()?;
        self.validate_dist()?;
        self.validate_polychromic()?;

        if !is_device(&t.device) {
            return Err(ConfigError::NotAllowed {
                key: "train.device",
                value: t.device.clone(),
                allowed: "auto, cpu, cuda, cuda:N (N = GPU index, e.g. cuda:0)".into(),
            });
        }
        one_of("train.precision", &t.precision, PRECISIONS)?;
        at_least_one("train.seq_len", t.seq_len)?;
        at_least_one("train.micro_batch", t.micro_batch)?;
        at_least_one("train.grad_accum", t.grad_accum)?;
        at_least_one("train.steps", t.steps)?;
        at_least_one("train.eval_batches", t.eval_batches)?;
        at_least_one("train.log_every", t.log_every)?;
        at_least_one(
            "train.loss_scale_growth_interval",
            t.loss_scale_growth_interval,
        )?;
        one_of("train.recompute", &t.recompute, RECOMPUTE)?;
        if !t.fused_kernels && !family.features.unfused_kernels {
            let with: Vec<String> = crate::models::family::FAMILIES
                .iter()
                .filter(|f| f.features.unfused_kernels)
                .map(|f| format!("model.kind = \"{}\"", f.kind))
                .collect();
            return Err(out_of_range(
                "train.fused_kernels",
                t.fused_kernels,
                format!(
                    "only {} has an unfused path, not \"{}\"; leave train.fused_kernels=true",
                    with.join(" and "),
                    family.kind
                ),
            ));
        }
        if !t.fused_kernels && t.offload_optimizer {
            return Err(out_of_range(
                "train.fused_kernels",
                t.fused_kernels,
                "the offloaded optimizer (train.offload_optimizer=true) has one host pass and no unfused form; set train.offload_optimizer=false or train.fused_kernels=true",
            ));
        }
        if t.epochs < 0.0 {
            return Err(out_of_range(
                "train.epochs",
                t.epochs,
                "it must be 0 (train.steps decides) or more, e.g. train.epochs=3",
            ));
        }
        if t.early_stop_min_delta < 0.0 {
            return Err(out_of_range(
                "train.early_stop_min_delta",
                t.early_stop_min_delta,
                "it must be 0 or more (a loss fall of at least this much counts as better)",
            ));
        }
        // Both choose among periodic evaluations.
        for (key, on, value, what) in [
            (
                "train.early_stop_patience",
                t.early_stop_patience > 0,
                t.early_stop_patience.to_string(),
                "it counts evaluations",
            ),
            (
                "train.keep_best",
                t.keep_best,
                t.keep_best.to_string(),
                "the best checkpoint is chosen among evaluations",
            ),
        ] {
            if on && t.eval_every == 0 {
                return Err(out_of_range(
                    key,
                    value,
                    format!(
                        "{what}, and train.eval_every=0 evaluates only at the end; set train.eval_every to the steps between evaluations, e.g. train.eval_every=50"
                    ),
                ));
            }
        }
        if let Err(rule) = parse_bytes(&t.memory_limit) {
            return Err(out_of_range("train.memory_limit", &t.memory_limit, rule));
        }
        if t.seq_len > m.context {
            return Err(ConfigError::SeqLenExceedsContext {
                seq_len: t.seq_len,
                context: m.context,
            });
        }
        if !is_power_of_two(t.loss_scale_init) {
            return Err(out_of_range(
                "train.loss_scale_init",
                t.loss_scale_init,
                "it must be a positive power of two, e.g. 65536",
            ));
        }

        if o.lr <= 0.0 {
            return Err(out_of_range(
                "optim.lr",
                o.lr,
                "it must be greater than 0, e.g. 0.003",
            ));
        }
        if !(0.0..=o.lr).contains(&o.min_lr) {
            return Err(out_of_range(
                "optim.min_lr",
                o.min_lr,
                format!(
                    "it must be between 0 and optim.lr ({}); lower optim.min_lr or raise optim.lr",
                    o.lr
                ),
            ));
        }
        for (key, beta) in [("optim.beta1", o.beta1), ("optim.beta2", o.beta2)] {
            if !(0.0..1.0).contains(&beta) {
                return Err(out_of_range(
                    key,
                    beta,
                    "it must be at least 0 and less than 1, e.g. 0.9",
                ));
            }
        }
        if o.eps <= 0.0 {
            return Err(out_of_range(
                "optim.eps",
                o.eps,
                "it must be greater than 0, e.g. 1e-8",
            ));
        }
        if o.weight_decay < 0.0 {
            return Err(out_of_range(
                "optim.weight_decay",
                o.weight_decay,
                "it must be 0 or more (0 disables decay)",
            ));
        }
        if o.grad_clip < 0.0 {
            return Err(out_of_range(
                "optim.grad_clip",
                o.grad_clip,
                "it must be 0 or more (0 disables clipping)",
            ));
        }
        Ok(())
    }
}

impl Config {
    /// The `[dist]` rules.
    fn validate_dist(&self) -> Result<(), ConfigError> {
        let d = &self.dist;
        if d.zero > 2 {
            return Err(out_of_range(
                "dist.zero",
                d.zero,
                "ZeRO stages are 0 (none), 1 (optimizer state) and 2 (optimizer state and gradients)",
            ));
        }
        for (key, value) in [
            ("dist.bucket_mb", d.bucket_mb),
            ("dist.timeout_s", d.timeout_s),
        ] {
            if !value.is_finite() {
                return Err(ConfigError::NotFinite { key, value });
            }
            if value <= 0.0 {
                return Err(out_of_range(key, value, "it must be positive"));
            }
        }
        if d.zero > 0 && self.train.offload_optimizer {
            return Err(out_of_range(
                "dist.zero",
                d.zero,
                "ZeRO shards the optimizer state across GPUs and train.offload_optimizer moves it to the host; choose one (set dist.zero=0 or train.offload_optimizer=false)",
            ));
        }
        Ok(())
    }

    /// The `[lora]` and `[scu]` rules.
    fn validate_lora(&self) -> Result<(), ConfigError> {
        let (l, s) = (&self.lora, &self.scu);
        for (key, value) in [
            ("lora.alpha", l.alpha),
            ("lora.dropout", l.dropout),
            ("scu.target", s.target),
            ("scu.kp", s.kp),
            ("scu.ki", s.ki),
            ("scu.sigma", s.sigma),
            ("scu.tokens_per_epoch", s.tokens_per_epoch),
            ("scu.ema", s.ema),
            ("scu.deadband", s.deadband),
            ("scu.leak", s.leak),
            ("scu.i_max", s.i_max),
            ("scu.lambda_init", s.lambda_init),
            ("scu.lambda_min", s.lambda_min),
            ("scu.lambda_max", s.lambda_max),
        ] {
            if !value.is_finite() {
                return Err(ConfigError::NotFinite { key, value });
            }
        }
        at_least_one("lora.rank", l.rank)?;
        if l.alpha <= 0.0 {
            return Err(out_of_range(
                "lora.alpha",
                l.alpha,
                "it must be positive, e.g. 32",
            ));
        }
        if !(0.0..1.0).contains(&l.dropout) {
            return Err(out_of_range(
                "lora.dropout",
                l.dropout,
                "a drop probability in [0, 1), for example 0.05",
            ));
        }
        if l.targets.split(',').all(|t| t.trim().is_empty()) {
            return Err(out_of_range(
                "lora.targets",
                &l.targets,
                "name at least one module, e.g. q_proj,v_proj, or all-linear",
            ));
        }
        one_of("lora.quantize", &l.quantize, &["none", "nf4"])?;
        if l.quantize == "nf4" && !l.enabled {
            return Err(out_of_range(
                "lora.quantize",
                &l.quantize,
                "an NF4 base is the frozen base under low-rank adapters: it needs lora.enabled=true (kiln finetune --qlora sets both)",
            ));
        }
        if l.enabled && l.base.is_empty() {
            return Err(out_of_range(
                "lora.base",
                "\"\"",
                "adapters need a base model: kiln finetune --init-from PATH sets it",
            ));
        }
        if !(s.target > 0.0 && s.target < 1.0) {
            return Err(out_of_range(
                "scu.target",
                s.target,
                "S* is a share of the bits per token: it must be in (0, 1), e.g. 0.02",
            ));
        }
        if s.sigma <= 0.0 || s.tokens_per_epoch < 0.0 {
            return Err(out_of_range(
                "scu.sigma",
                s.sigma,
                "scu.sigma must be positive and scu.tokens_per_epoch 0 or more",
            ));
        }
        if !(s.ema > 0.0 && s.ema <= 1.0 && (0.0..=1.0).contains(&s.leak)) {
            return Err(out_of_range(
                "scu.ema",
                s.ema,
                "scu.ema must be in (0, 1] and scu.leak in [0, 1]",
            ));
        }
        let in_bounds =
            s.lambda_min > 0.0 && s.lambda_min <= s.lambda_init && s.lambda_init <= s.lambda_max;
        let fixed_zero = s.lambda_init == 0.0 && !s.control;
        if !(in_bounds || fixed_zero) {
            return Err(out_of_range(
                "scu.lambda_init",
                s.lambda_init,
                format!(
                    "it must lie in [scu.lambda_min, scu.lambda_max] = [{}, {}] with scu.lambda_min > 0 (0 is allowed only with scu.control=false, a fixed lambda)",
                    s.lambda_min, s.lambda_max
                ),
            ));
        }
        if s.kp < 0.0 || s.ki < 0.0 || s.deadband < 0.0 || s.i_max < 0.0 {
            return Err(out_of_range(
                "scu.kp",
                s.kp,
                "the gains, scu.deadband and scu.i_max must be 0 or more",
            ));
        }
        at_least_one("scu.every", s.every)?;
        if s.enabled && !l.enabled {
            return Err(out_of_range(
                "scu.enabled",
                true,
                "the penalty is on the adapters: it needs lora.enabled=true (kiln finetune)",
            ));
        }
        Ok(())
    }

    /// The `[polychromic]` rules.
    fn validate_polychromic(&self) -> Result<(), ConfigError> {
        let p = &self.polychromic;
        for (key, value) in [
            ("polychromic.lambda", p.lambda),
            ("polychromic.temperature", p.temperature),
            ("polychromic.top_p", p.top_p),
        ] {
            if !value.is_finite() {
                return Err(ConfigError::NotFinite { key, value });
            }
        }
        if p.samples < 2 {
            return Err(out_of_range(
                "polychromic.samples",
                p.samples,
                "D is the mean distance over pairs of a prompt's replies, so it needs at least 2 (e.g. 4)",
            ));
        }
        at_least_one("polychromic.prompts", p.prompts)?;
        at_least_one("polychromic.every", p.every)?;
        at_least_one("polychromic.max_new_tokens", p.max_new_tokens)?;
        if p.temperature <= 0.0 {
            return Err(out_of_range(
                "polychromic.temperature",
                p.temperature,
                "it must be positive: at 0 (greedy) every reply to a prompt is the same, so D and its gradient are 0; 1 samples the model as it is",
            ));
        }
        if !(p.top_p > 0.0 && p.top_p <= 1.0) {
            return Err(out_of_range(
                "polychromic.top_p",
                p.top_p,
                "it must be in (0, 1]; 1 keeps the whole distribution",
            ));
        }
        if p.lambda < 0.0 && !p.allow_negative_lambda {
            return Err(out_of_range(
                "polychromic.lambda",
                p.lambda,
                "a negative lambda rewards replies for resembling each other; use 0 or more, or add --allow-negative-lambda (polychromic.allow_negative_lambda=true) if sameness is the aim",
            ));
        }
        Ok(())
    }
}

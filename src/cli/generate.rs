//! `kiln generate`: sample text from a kiln run or an imported model, one prompt streamed to
//! the terminal or many prompts from a JSON-lines file, several samples each.

use crate::data::{self, Tokenizer};

use crate::error::{KilnError, Result};
use crate::generate::{self, Options, Request, Sampling};
use crate::models::Model;
use crate::train;
use clap::Args;
use std::io::{BufRead, Write};
use std::path::PathBuf;

#[derive(Args, Debug)]
#[command(after_help = "EXAMPLES:
  kiln generate                                     sample from the most recent run
  kiln generate --prompt 'JULIET:' --tokens 400 --temperature 0.7
  kiln generate --run runs/big --top-k 0 --seed 7   top-k 0 samples from the full distribution
  kiln generate --init-from SmolLM2-135M-Instruct.Q4_1.gguf --chat --prompt 'What is the capital of France?' --temperature 0
  kiln generate --init-from DIR --chat --system 'Answer in one word.' --prompt 'Capital of Peru?'
  kiln generate --init-from SmolLM2-135M-Instruct.Q4_1.gguf -i --temperature 0.7   a conversation
  kiln generate --init-from DIR --prompts prompts.jsonl --num-samples 4 --out replies.jsonl
  kiln generate --run runs/big --checkpoint step_400  an earlier checkpoint

--prompts reads one JSON object per line: {\"prompt\": \"...\"} (with --chat, {\"messages\":
[{\"role\": \"user\", \"content\": \"...\"}]} or a prompt that becomes the user's message) and
writes one JSON object per prompt: the prompt, its samples' texts, token ids and per-token
log-probabilities. A summary of prefill and decode tokens/s goes to standard error.")]
pub struct GenerateArgs {
    /// Run directory written by `kiln train` (default: the most recent run).
    #[arg(long, value_name = "DIR", conflicts_with = "init_from")]
    pub run: Option<PathBuf>,
    /// A pretrained model instead of a kiln run: a Hugging Face directory or a GGUF file.
    #[arg(long, value_name = "PATH")]
    pub init_from: Option<PathBuf>,
    /// With --init-from: low-rank adapters in PEFT's format (adapter_config.json and
    /// adapter_model.safetensors, e.g. a fine-tune's DIR/adapter) applied to the base.
    #[arg(long, value_name = "DIR", requires = "init_from")]
    pub adapter: Option<PathBuf>,
    /// Text to continue (or, with --chat, the user's message).
    #[arg(long, default_value = "ROMEO:")]
    pub prompt: String,
    /// A JSON-lines file of prompts; the replies go to --out or standard output.
    #[arg(long, value_name = "FILE", conflicts_with = "prompt")]
    pub prompts: Option<PathBuf>,
    /// Where --prompts writes its JSON lines (default: standard output).
    #[arg(long, value_name = "FILE", requires = "prompts")]
    pub out: Option<PathBuf>,
    /// Render prompts through the model's chat template (imported models).
    #[arg(long)]
    pub chat: bool,
    /// With --chat or --interactive: a system message before each prompt given as text
    /// (--prompt, or a --prompts line's "prompt"; a line's own "messages" stay as written).
    /// Without it the template's own default applies, as in transformers.
    #[arg(long, value_name = "TEXT")]
    pub system: Option<String>,
    /// A conversation: each line read from standard input is the user's turn, answered
    /// through the chat template with the turns before it (implies --chat). `/undo` takes
    /// back the last exchange, `/save FILE` appends the conversation to FILE as a line of
    /// chat messages (the shape --prompts and kiln finetune --data read), `/reset` forgets
    /// the turns, `/exit` or end of input ends it; the oldest turns are dropped when the
    /// conversation outgrows the context.
    #[arg(short, long, conflicts_with_all = ["prompts", "prompt", "num_samples"])]
    pub interactive: bool,
    /// Replies per prompt (sharing the prompt's prefill).
    #[arg(long, default_value_t = 1)]
    pub num_samples: usize,
    /// Most new tokens per reply (transformers' max_new_tokens).
    #[arg(long, visible_alias = "max-new-tokens", default_value_t = 300)]
    pub tokens: usize,
    /// Softmax temperature; 0 picks the most likely token.
    #[arg(long, default_value_t = 0.8, allow_negative_numbers = true)]
    pub temperature: f32,
    /// Sample only among the K most likely tokens (0 = all).
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    /// Nucleus sampling: the smallest set of tokens whose probability reaches P (1 = off).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub top_p: f32,
    /// Drop tokens less likely than P times the most likely (0 = off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub min_p: f32,
    /// Penalise tokens already in the sequence (1 = off, e.g. 1.1).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub repetition_penalty: f32,
    /// Stop a reply where this text appears (repeatable); imported models also stop at
    /// their end-of-sequence tokens.
    #[arg(long, value_name = "TEXT")]
    pub stop: Vec<String>,
    /// Seed for sampling.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Where to run: auto (the first GPU, else the CPU), cpu, cuda or cuda:N.
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Weights and activations on a GPU: bf16 (the default there) or fp32. The CPU runs fp32.
    #[arg(long, value_name = "fp32|bf16")]
    pub precision: Option<String>,
    /// Sample from this checkpoint (step_N, N, or best: a train.keep_best run's lowest
    /// validation loss) instead of the latest.
    #[arg(long, value_name = "step_N")]
    pub checkpoint: Option<String>,
    /// Run every decode step as its kernels one by one instead of replaying it from a CUDA
    /// graph (the output is the same; graphs only save launch time).
    #[arg(long)]
    pub no_cuda_graphs: bool,
    /// Wait for each decode step's tokens before queueing the next step, instead of running
    /// the next step while the host reads them (the output is the same).
    #[arg(long)]
    pub no_overlap: bool,
    /// Cut a prompt longer than the model's context from the left (keeping its end and room
    /// for --tokens) instead of refusing it.
    #[arg(long)]
    pub truncate_left: bool,
    /// Decode at most N sequences at once; the others wait and take the slots of finished
    /// ones (default: all at once, or as many as fit in memory).
    #[arg(long, value_name = "N")]
    pub max_batch: Option<usize>,
}

impl GenerateArgs {
    /// Refuses arguments that would print garbage or nothing, before the model is loaded.
    fn validate(&self) -> Result<()> {
        if self.system.is_some() && !self.chat && !self.interactive {
            return Err(KilnError::Setting(
                "--system is a chat message: give --chat (or --interactive) with it".into(),
            ));
        }
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(KilnError::Setting(format!(
                "--temperature {} must be a finite number of 0 or more (0 picks the most likely token; 0.7 to 1.0 is usual)",
                self.temperature
            )));
        }
        if self.tokens == 0 {
            return Err(KilnError::Setting(
                "--tokens 0 generates nothing; give 1 or more".into(),
            ));
        }
        if self.max_batch == Some(0) {
            return Err(KilnError::Setting(
                "--max-batch 0 decodes nothing; give 1 or more".into(),
            ));
        }
        Ok(())
    }
}

/// A model ready to sample from, with its tokenizer and what ends its replies.
struct Loaded {
    model: Box<dyn Model>,
    tokenizer: Box<dyn Tokenizer>,
    stop_ids: Vec<u32>,
    /// The BOS id put in front of a plain prompt, where the model's tokenizer asks for one
    /// (`add_bos_token`: Llama 2, Mistral), as transformers' tokenizer and llama.cpp do. A
    /// chat prompt takes its BOS from the template's text instead.
    prompt_bos: Option<u32>,
    chat: Option<ChatTemplate>,
    model_cfg: crate::config::ModelConfig,
    vocab: usize,
    /// Where it runs, for the summary line.
    note: String,
}

/// A chat template with the special tokens it refers to.
struct ChatTemplate {
    template: String,
    bos: String,
    eos: String,
}

fn load(a: &GenerateArgs) -> Result<Loaded> {
    let mut l = load_on_cpu(a)?;
    // Low-rank adapters are folded into the f32 base for sampling: the same function, one
    // GEMM per projection.
    l.model.merge_lora()?;
    let (model, note) = crate::generate::load::to_device(
        l.model,
        &l.model_cfg,
        l.vocab,
        &a.device,
        a.precision.as_deref(),
    )?;
    l.model = model;
    l.note = note;
    Ok(l)
}

fn load_on_cpu(a: &GenerateArgs) -> Result<Loaded> {
    if let Some(path) = &a.init_from {
        return load_pretrained(path, a.adapter.as_deref());
    }
    let run_dir = super::find_run(a.run.clone())?;
    let loaded = train::load_run(&run_dir, a.checkpoint.as_deref())?;
    if let Some(w) = &loaded.unverified {
        eprintln!("warning: {w}");
    }
    let vocab = train::model_vocab(&loaded.config)?;
    let name = &loaded.config.data.tokenizer;
    // A run fine-tuned from a pretrained model keeps that model's tokenizer (its path), and
    // with it the chat template and the end-of-turn ids its replies stop on.
    let (tokenizer, stop_ids, prompt_bos, chat): (Box<dyn Tokenizer>, _, _, _) =
        if data::is_tokenizer_path(name) {
            let hf = data::tokenizer_from_path(std::path::Path::new(name))?;
            let (stop, bos, chat) = (hf.eos_ids(), prompt_bos_of(&hf), chat_template_of(&hf));
            (Box::new(hf), stop, bos, chat)
        } else {
            (data::tokenizer_by_name(name)?, Vec::new(), None, None)
        };
    Ok(Loaded {
        model: loaded.model,
        tokenizer,
        stop_ids,
        prompt_bos,
        chat,
        model_cfg: loaded.config.model,
        vocab,
        note: String::new(),
    })
}

/// The BOS id a plain prompt starts with, if the tokenizer adds one.
fn prompt_bos_of(t: &data::HfTokenizer) -> Option<u32> {
    t.bos_id().filter(|_| t.adds_bos())
}

/// The tokenizer's chat template with the special tokens it refers to, if it has one.
fn chat_template_of(t: &data::HfTokenizer) -> Option<ChatTemplate> {
    t.chat_template().map(|template| ChatTemplate {
        template: template.to_string(),
        bos: t.bos_token().to_string(),
        eos: t.eos_token().to_string(),
    })
}

fn load_pretrained(path: &std::path::Path, adapter: Option<&std::path::Path>) -> Result<Loaded> {
    let p = crate::models::import::pretrained::open(path)?;
    let mut model = p.build_on_cpu()?;
    if let Some(dir) = adapter {
        crate::models::peft::apply(model.as_mut(), dir)?;
    }
    let chat = chat_template_of(&p.tokenizer);
    Ok(Loaded {
        model,
        stop_ids: p.tokenizer.eos_ids(),
        prompt_bos: prompt_bos_of(&p.tokenizer),
        tokenizer: Box::new(p.tokenizer),
        chat,
        model_cfg: p.model,
        vocab: p.vocab,
        note: String::new(),
    })
}

/// One prompt of a `--prompts` file.
#[derive(serde::Deserialize)]
struct PromptLine {
    prompt: Option<String>,
    messages: Option<Vec<data::ChatMessage>>,
}

fn render(
    l: &Loaded,
    chat: bool,
    system: Option<&str>,
    prompt: Option<String>,
    messages: Option<Vec<data::ChatMessage>>,
    line: usize,
) -> Result<String> {
    if !chat {
        return prompt
            .ok_or_else(|| KilnError::Setting(format!("prompt {line} has no \"prompt\" field")));
    }
    let t = l.chat.as_ref().ok_or_else(|| {
        KilnError::Setting("--chat needs a model with a chat template; this one has none".into())
    })?;
    let messages = match (messages, prompt) {
        (Some(m), _) => m,
        (None, Some(p)) => system
            .map(|s| data::ChatMessage::new("system", s))
            .into_iter()
            .chain([data::ChatMessage::new("user", p)])
            .collect(),
        (None, None) => {
            return Err(KilnError::Setting(format!(
                "prompt {line} has neither \"prompt\" nor \"messages\""
            )));
        }
    };
    Ok(data::render_chat(
        &t.template,
        &messages,
        true,
        &t.bos,
        &t.eos,
    )?)
}

/// A prompt's ids: a plain prompt gets the BOS its tokenizer asks for (unless its text
/// already starts with it); a chat prompt is its rendered template as written, which places
/// the BOS itself (transformers' `apply_chat_template` adds no special tokens either).
fn encode_prompt(tok: &dyn Tokenizer, prompt_bos: Option<u32>, text: &str, chat: bool) -> Vec<u32> {
    let mut ids = tok.encode(text);
    if let Some(bos) = prompt_bos.filter(|_| !chat)
        && !ids.is_empty()
        && ids[0] != bos
    {
        ids.insert(0, bos);
    }
    ids
}

pub fn run(a: GenerateArgs) -> Result<()> {
    a.validate()?;
    let sampling = Sampling {
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        min_p: a.min_p,
        repetition_penalty: a.repetition_penalty,
    };
    sampling.check().map_err(KilnError::Setting)?;
    if a.num_samples == 0 {
        return Err(KilnError::Setting(
            "--num-samples 0 draws nothing; use 1 or more".into(),
        ));
    }
    if a.stop.iter().any(String::is_empty) {
        return Err(KilnError::Setting("--stop needs a non-empty text".into()));
    }
    let l = load(&a)?;
    generate::check_stop_strings(l.tokenizer.as_ref(), &a.stop)?;
    if a.interactive {
        return converse(&a, &l, sampling);
    }
    let mut texts = Vec::new();
    match &a.prompts {
        None => texts.push(render(
            &l,
            a.chat,
            a.system.as_deref(),
            Some(a.prompt.clone()),
            None,
            1,
        )?),
        Some(path) => {
            let f = std::fs::File::open(path).map_err(|e| {
                KilnError::Data(data::DataError::File {
                    path: path.clone(),
                    reason: format!("cannot be read ({e}); check the --prompts path"),
                })
            })?;
            for (i, line) in std::io::BufReader::new(f).lines().enumerate() {
                let file_error = |reason: String| {
                    KilnError::Data(data::DataError::File {
                        path: path.clone(),
                        reason,
                    })
                };
                let line = line.map_err(|e| file_error(format!("line {}: {e}", i + 1)))?;
                if line.trim().is_empty() {
                    continue;
                }
                let p: PromptLine = serde_json::from_str(&line).map_err(|e| {
                    file_error(format!(
                        "line {} is not a prompt object ({e}); write {{\"prompt\": \"...\"}} per line",
                        i + 1
                    ))
                })?;
                texts.push(render(
                    &l,
                    a.chat,
                    a.system.as_deref(),
                    p.prompt,
                    p.messages,
                    i + 1,
                )?);
            }
        }
    }
    let reqs: Vec<Request> = texts
        .iter()
        .map(|t| Request {
            prompt: encode_prompt(l.tokenizer.as_ref(), l.prompt_bos, t, a.chat),
            samples: a.num_samples,
        })
        .collect();
    if let Some(i) = reqs.iter().position(|r| r.prompt.is_empty()) {
        return Err(KilnError::Setting(match &a.prompts {
            None => "--prompt is empty; give at least one character to continue".into(),
            Some(p) => format!(
                "prompt {} of {} is empty; give each prompt some text",
                i + 1,
                p.display()
            ),
        }));
    }
    let opts = Options {
        max_new_tokens: a.tokens,
        sampling,
        stop_ids: l.stop_ids.clone(),
        stop_strings: a.stop.clone(),
        seed: a.seed,
        cuda_graphs: !a.no_cuda_graphs,
        overlap_steps: !a.no_overlap,
        truncate_left: a.truncate_left,
        max_batch: a.max_batch,
    };
    let stream = a.prompts.is_none() && a.num_samples == 1;
    let mut out = std::io::stdout();
    // The prompt is echoed with the first token (or after the run when no token comes), not
    // before: a prompt the engine refuses (too long, say) prints its error alone.
    let echo = stream && !a.chat;
    let mut echoed = false;
    // Whole characters only, with the spaces a decoder gives a token after others.
    let mut streamed = generate::text_stream::TextStream::new(
        l.tokenizer.as_ref(),
        reqs.first().map_or(&[][..], |r| &r.prompt),
    );
    let tokenizer = &l.tokenizer;
    let mut on_token = |_: usize, _: usize, t: u32| {
        if !stream || opts.stop_ids.contains(&t) {
            return;
        }
        if echo && !echoed {
            print!("{}", texts[0]);
            echoed = true;
        }
        if let Some(text) = streamed.push(tokenizer.as_ref(), t) {
            print!("{text}");
            let _ = out.flush();
        }
    };
    let (done, stats) = generate::generate(
        l.model.as_ref(),
        l.tokenizer.as_ref(),
        &reqs,
        &opts,
        &mut on_token,
    )?;
    if stream {
        if echo && !echoed {
            print!("{}", texts[0]);
        }
        println!("{}", streamed.finish(l.tokenizer.as_ref()));
    } else {
        let mut sink: Box<dyn Write> = match &a.out {
            Some(p) => Box::new(std::fs::File::create(p).map_err(|e| KilnError::output(p, e))?),
            None => Box::new(std::io::stdout()),
        };
        for (i, text) in texts.iter().enumerate() {
            let samples: Vec<_> = done.iter().filter(|c| c.prompt == i).collect();
            let line = serde_json::json!({
                "prompt": text,
                "prompt_tokens": reqs[i].prompt,
                "samples": samples,
            });
            writeln!(sink, "{line}")
                .map_err(|e| KilnError::output(a.out.clone().unwrap_or_default(), e))?;
        }
    }
    let truncated: Vec<String> = done
        .iter()
        .filter(|c| c.truncated > 0 && c.sample == 0)
        .map(|c| {
            format!(
                "prompt {} lost its first {} tokens",
                c.prompt + 1,
                c.truncated
            )
        })
        .collect();
    if !truncated.is_empty() {
        eprintln!("--truncate-left: {}", truncated.join("; "));
    }
    // The pool's peak over loading and generation: what `kiln plan --generate` predicts.
    let pool_peak = l
        .model
        .params()
        .first()
        .map(|p| p.value.pool().stats().peak);
    eprintln!("{}", summary(&l.note, &stats, pool_peak));
    let sequences: usize = reqs.iter().map(|r| r.samples).sum();
    let asked = a.max_batch.unwrap_or(usize::MAX).min(sequences);
    if stats.slots > 0 && stats.slots < asked {
        eprintln!(
            "note: the key/value cache for {asked} sequences at once did not fit; {} ran at once and the others took freed slots ({} of cache). `kiln plan --generate` gives the figures and the most that fit",
            stats.slots,
            crate::plan::gib(stats.cache_bytes)
        );
    }
    Ok(())
}

/// `--interactive`: a conversation on standard input, each line the user's turn and each
/// reply streamed as it is drawn. The whole conversation is prefilled again each turn (no
/// cache is kept between turns); when it no longer fits the context with room for a reply,
/// its oldest turns after the system message are dropped, as chat front ends do.
fn converse(a: &GenerateArgs, l: &Loaded, sampling: Sampling) -> Result<()> {
    use std::io::IsTerminal;
    let t = l.chat.as_ref().ok_or_else(|| {
        KilnError::Setting(
            "--interactive renders the conversation with the model's chat template, and this model has none; use --prompt or --prompts".into(),
        )
    })?;
    let tok = l.tokenizer.as_ref();
    let context = l.model_cfg.context;
    let stdin = std::io::stdin();
    let terminal = stdin.is_terminal();
    if terminal {
        eprintln!(
            "{}: type a message and press Enter; /undo takes back the last exchange, /save FILE appends the conversation to FILE as a line of chat messages, /reset forgets it, /exit or Ctrl-D ends it",
            l.note
        );
    }
    let first: Vec<data::ChatMessage> = a
        .system
        .iter()
        .map(|s| data::ChatMessage::new("system", s.as_str()))
        .collect();
    let mut history = first.clone();
    let mut out = std::io::stdout();
    let mut totals = generate::Stats::default();
    // The keys and values of the conversation so far, kept between turns.
    let mut kept = generate::Conversation::new();
    let mut turn: u64 = 0;
    for line in stdin.lock().lines() {
        let line = line.map_err(|e| KilnError::Setting(format!("standard input: {e}")))?;
        let said = line.trim();
        match said {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                history.clone_from(&first);
                kept.forget();
                eprintln!("(the conversation is forgotten)");
                continue;
            }
            // The cache keeps what the next prompt shares with it, so nothing is run again.
            "/undo" => {
                match history.len() > first.len() {
                    true => {
                        history.pop();
                        if history.len() > first.len()
                            && history.last().is_some_and(|m| m.role == "user")
                        {
                            history.pop();
                        }
                        eprintln!("(the last exchange is taken back)");
                    }
                    false => eprintln!("(nothing to take back)"),
                }
                continue;
            }
            _ => {}
        }
        if said == "/save" || said.starts_with("/save ") {
            let file = said["/save".len()..].trim();
            match save_conversation(file, &history) {
                Ok(()) => eprintln!(
                    "(the conversation, {} messages, appended to {file})",
                    history.len()
                ),
                Err(why) => eprintln!("(not saved: {why})"),
            }
            continue;
        }
        history.push(data::ChatMessage::new("user", said));
        // The conversation as prompt ids, dropping the oldest exchange until it leaves room
        // for a reply of a token or more.
        let prompt = loop {
            let text = data::render_chat(&t.template, &history, true, &t.bos, &t.eos)?;
            let ids = encode_prompt(tok, l.prompt_bos, &text, true);
            if ids.len() < context || history.len() <= first.len() + 1 {
                break ids;
            }
            // The oldest turn after the system message, and its reply with it.
            history.remove(first.len());
            if history.len() > first.len() + 1 && history[first.len()].role == "assistant" {
                history.remove(first.len());
            }
            eprintln!("(the oldest turns were dropped to fit the context of {context} tokens)");
        };
        if prompt.len() >= context {
            eprintln!(
                "this message makes a prompt of {} tokens, {} more than the context of {context} leaves room for; say it in fewer words",
                prompt.len(),
                prompt.len() + 1 - context
            );
            history.pop();
            continue;
        }
        let opts = Options {
            max_new_tokens: a.tokens,
            sampling,
            stop_ids: l.stop_ids.clone(),
            stop_strings: a.stop.clone(),
            // Each turn its own draws, the conversation reproducible from --seed.
            seed: a.seed.wrapping_add(turn),
            cuda_graphs: !a.no_cuda_graphs,
            overlap_steps: !a.no_overlap,
            truncate_left: false,
            max_batch: None,
        };
        let mut streamed = generate::text_stream::TextStream::new(tok, &prompt);
        let mut on_token = |_: usize, _: usize, id: u32| {
            if opts.stop_ids.contains(&id) {
                return;
            }
            if let Some(text) = streamed.push(tok, id) {
                print!("{text}");
                let _ = out.flush();
            }
        };
        let (done, stats) = generate::generate_turn(
            l.model.as_ref(),
            tok,
            &mut kept,
            &prompt,
            &opts,
            &mut on_token,
        )?;
        println!("{}", streamed.finish(tok));
        history.push(data::ChatMessage::new("assistant", done.text));
        totals.reused_tokens += stats.reused_tokens;
        totals.prefill_tokens += stats.prefill_tokens;
        totals.prefill_secs += stats.prefill_secs;
        totals.decode_tokens += stats.decode_tokens;
        totals.decode_secs += stats.decode_secs;
        turn += 1;
    }
    if turn > 0 {
        eprintln!("{} turns; {}", turn, summary(&l.note, &totals, None));
    }
    Ok(())
}

/// Appends `history` to `file` as one JSON line `{"messages": [...]}`, the chat shape that
/// `kiln finetune --data` and `kiln generate --prompts` read. The reason when it cannot.
fn save_conversation(file: &str, history: &[data::ChatMessage]) -> std::result::Result<(), String> {
    use std::io::Write as _;
    if file.is_empty() {
        return Err("give a file, as in /save chats.jsonl".into());
    }
    if history.is_empty() {
        return Err("the conversation is empty".into());
    }
    let messages: Vec<serde_json::Value> = history
        .iter()
        .map(|m| serde_json::json!({"role": m.role, "content": m.content}))
        .collect();
    let line = serde_json::json!({ "messages": messages }).to_string();
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(file)
        .and_then(|mut f| writeln!(f, "{line}"))
        .map_err(|e| format!("{file}: {e}"))
}

/// The closing line: prefill and decode rates, how decode steps ran, and the pool's peak.
fn summary(note: &str, stats: &generate::Stats, pool_peak: Option<usize>) -> String {
    let graphs = match (&stats.graphs_off, stats.graph_replays) {
        (Some(why), _) => format!("; CUDA graphs off: {why}"),
        (None, 0) => String::new(),
        (None, n) => format!(
            "; {n} of {} steps replayed from CUDA graphs",
            stats.decode_steps
        ),
    };
    let peak = pool_peak
        .map(|b| format!("; pool peak {} ({b} bytes)", crate::plan::gib(b)))
        .unwrap_or_default();
    let restarts = match stats.restarts {
        0 => String::new(),
        n => format!("; {n} sequences prefilled again past LongRoPE's trained context"),
    };
    let reused = match stats.reused_tokens {
        0 => String::new(),
        n => format!(" ({n} more read from the conversation's cache)"),
    };
    format!(
        "{note}: prefill {} tokens{reused} at {:.0} tok/s, decode {} tokens at {:.0} tok/s{graphs}{restarts}{peak}",
        stats.prefill_tokens,
        stats.prefill_rate(),
        stats.decode_tokens,
        stats.decode_rate()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A vocabulary that asks for BOS (the SentencePiece fixture's GGUF metadata, as Llama 2's
    /// files do) puts it in front of a plain prompt once, and leaves a chat prompt as its
    /// template wrote it; one that does not ask gets none.
    #[test]
    fn plain_prompts_start_with_bos_where_the_tokenizer_asks() {
        let tok = crate::data::hf_tokenizer::spm_fixture_tokenizer();
        let bos = prompt_bos_of(&tok);
        assert_eq!(bos, Some(1));
        let text = "ROMEO: Wherefore art thou?";
        let plain = tok.encode(text);
        assert_ne!(plain[0], 1);
        let mut want = vec![1];
        want.extend(&plain);
        assert_eq!(encode_prompt(&tok, bos, text, false), want);
        assert_eq!(encode_prompt(&tok, bos, text, true), plain);
        // A text that starts with the BOS token already keeps one.
        assert_eq!(
            encode_prompt(&tok, bos, &format!("<s>{text}"), false)[..2],
            [1, plain[0]]
        );
        assert_eq!(encode_prompt(&tok, None, text, false), plain);
        assert!(encode_prompt(&tok, bos, "", false).is_empty());
    }
}

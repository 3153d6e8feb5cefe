//! Measuring a prompt before admission: the model's own tokenizer and chat template count
//! it, a prompt that fills the context is refused before it costs a GPU anything, and the
//! count bounds what a node may bill (SPEC section 7, trust).

use serde_json::{Map, Value};
use switchyard_actors::ports::UsageBounds;
use switchyard_actors::protocol::Api;

use crate::config::{ModelConfig, TrustSettings};
use crate::tokens::{PromptCounter, TokenizerError};

/// What a request's prompt is, to count it before admission.
#[derive(Debug, Clone)]
pub enum Prompt {
    /// A chat body's `messages` (and the fields its template renders).
    Chat,
    /// Plain texts and client-tokenized ids: a legacy completion's `prompt`, an embeddings
    /// request's `input`.
    Texts {
        /// The engine API.
        api: Api,
        /// The texts.
        texts: Vec<String>,
        /// Inputs given as token ids: their lengths.
        token_lists: Vec<u64>,
        /// The body field they came from, for errors.
        param: &'static str,
    },
}

impl Prompt {
    /// The engine API the request runs on.
    pub fn api(&self) -> Api {
        match self {
            Prompt::Chat => Api::Chat,
            Prompt::Texts { api, .. } => *api,
        }
    }

    /// The body field the prompt came from, named in a refusal.
    pub fn param(&self) -> &'static str {
        match self {
            Prompt::Chat => "messages",
            Prompt::Texts { param, .. } => param,
        }
    }
}

/// What the gateway counted of a request's prompt, and what that allows a node to bill.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Measured {
    /// The messages' tokens through the model's template: the reservation's estimate.
    pub prompt_tokens: u64,
    /// The most a node may report (SPEC section 7, trust).
    pub bounds: UsageBounds,
    /// The prompt's full KV blocks ([`crate::tokens::PromptCount::blocks`]), for routing.
    pub blocks: Vec<u64>,
}

/// Why a prompt was not admitted by its measure.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MeasureError {
    /// The engine body is not a JSON object (validation should have made this impossible).
    #[error("The body must be a JSON object.")]
    NotAnObject,
    /// The model's chat template cannot render these messages: the engine could not either.
    #[error("The messages cannot be rendered with the model's chat template.")]
    Template,
    /// The tokenizer failed or is missing (logged where it happened, by kind only: its
    /// message may quote the prompt); nothing was started.
    #[error("The prompt could not be counted; nothing was started.")]
    Uncounted,
    /// The prompt alone fills the model's context.
    #[error(
        "This model's maximum context length is {context} tokens; the `{param}` count {}{counted} tokens, which leaves no room for output.",
        at_least_word(.at_least)
    )]
    ContextLength {
        /// The model's context, in tokens.
        context: u64,
        /// The body field counted.
        param: &'static str,
        /// The count is a lower bound (the text was too long to be worth tokenizing).
        at_least: bool,
        /// The tokens counted.
        counted: u64,
    },
}

impl MeasureError {
    /// The body field the refusal is about, for `error.param`.
    pub fn param(&self) -> Option<&'static str> {
        match self {
            Self::Template => Some("messages"),
            Self::ContextLength { param, .. } => Some(param),
            Self::NotAnObject | Self::Uncounted => None,
        }
    }
}

fn at_least_word(at_least: &bool) -> &'static str {
    if *at_least { "at least " } else { "" }
}

/// Counts the prompt of `body` with the model's tokenizer and chat template. The count plus
/// the configured margin (and the tokens of tool definitions and other non-text fields an
/// engine's template may render) bounds the prompt tokens a node may bill, and
/// min(`max_tokens`, context) the completion tokens. A chat prompt's full blocks of
/// `block_size` tokens are hashed for routing (none with 0).
pub async fn measure(
    prompts: &PromptCounter,
    trust: &TrustSettings,
    model: &ModelConfig,
    body: &Value,
    prompt: &Prompt,
    max_tokens: u64,
    block_size: u32,
) -> Result<Measured, MeasureError> {
    let Value::Object(body) = body else {
        return Err(MeasureError::NotAnObject);
    };
    let context = u64::from(model.max_context_tokens);
    let count = match count(prompts, model, body, prompt, context, block_size).await {
        Some(Ok(count)) => count,
        Some(Err(TokenizerError::Template(_))) => return Err(MeasureError::Template),
        Some(Err(e)) => {
            // The kind only: the tokenizer's message may quote the prompt.
            tracing::error!(model = %model.name, kind = e.kind(), "counting a prompt failed");
            return Err(MeasureError::Uncounted);
        }
        None => {
            tracing::error!(model = %model.name, "no tokenizer loaded for a configured model");
            return Err(MeasureError::Uncounted);
        }
    };
    // An embedding has no output: each input may fill the context.
    let (counted, room_needed) = match prompt.api() {
        Api::Embeddings => (count.largest, 0),
        _ => (count.messages, 1),
    };
    if counted.saturating_add(room_needed) > context {
        return Err(MeasureError::ContextLength {
            context,
            param: prompt.param(),
            at_least: count.at_least,
            counted,
        });
    }
    let counted = count.messages.saturating_add(count.extra);
    let margin = (counted.saturating_mul(u64::from(trust.prompt_margin_percent)) / 100)
        .max(u64::from(trust.prompt_margin_tokens));
    Ok(Measured {
        prompt_tokens: count.messages,
        bounds: UsageBounds {
            prompt_tokens: counted.saturating_add(margin),
            completion_tokens: max_tokens.min(context),
        },
        blocks: count.blocks,
    })
}

async fn count(
    prompts: &PromptCounter,
    model: &ModelConfig,
    body: &Map<String, Value>,
    prompt: &Prompt,
    context: u64,
    block_size: u32,
) -> Option<Result<crate::tokens::PromptCount, TokenizerError>> {
    match prompt {
        Prompt::Chat => {
            prompts
                .count_chat(&model.name, body, context, block_size)
                .await
        }
        Prompt::Texts {
            api,
            texts,
            token_lists,
            ..
        } => {
            // Each embedding input is its own sequence; a completion's prompt is one.
            let each = *api == Api::Embeddings;
            let (texts, lists) = (texts.clone(), token_lists.clone());
            prompts
                .count_texts(&model.name, texts, lists, context, each)
                .await
        }
    }
}

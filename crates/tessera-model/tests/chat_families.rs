//! The chat templates of the MoE families Tessera runs — gpt-oss's harmony format, DeepSeek's,
//! GLM's and Llama 4's — render exactly as Hugging Face's `transformers` renders them (Jinja2
//! under its conventions; expected strings by `tools/render_chat_template.py`, see
//! `tests/templates/README.md`). gpt-oss's names the current date: the rendering is checked
//! with that date put back to the one the expected strings were made with.

use tessera_model::{ChatMessage, ChatTemplate};

/// (template, BOS, EOS, expected renderings as JSON)
const FAMILIES: [(&str, &str, &str, &str); 4] = [
    (
        include_str!("templates/openai-gpt-oss-120b.jinja"),
        "<|startoftext|>",
        "<|return|>",
        include_str!("templates/openai-gpt-oss-120b.expected.json"),
    ),
    (
        include_str!("templates/deepseek-ai-DeepSeek-V3.1.jinja"),
        "<｜begin▁of▁sentence｜>",
        "<｜end▁of▁sentence｜>",
        include_str!("templates/deepseek-ai-DeepSeek-V3.1.expected.json"),
    ),
    (
        include_str!("templates/GLM-4.6.jinja"),
        "[gMASK]<sop>",
        "<|endoftext|>",
        include_str!("templates/GLM-4.6.expected.json"),
    ),
    (
        include_str!("templates/meta-llama-Llama-4-Scout-17B-16E-Instruct.jinja"),
        "<|begin_of_text|>",
        "<|eot|>",
        include_str!("templates/meta-llama-Llama-4-Scout-17B-16E-Instruct.expected.json"),
    ),
];

/// The conversations of `tools/render_chat_template.py`.
fn conversation(name: &str) -> Vec<ChatMessage> {
    let m = ChatMessage::new;
    match name {
        "sys_user" => vec![
            m("system", "You are a helpful assistant."),
            m("user", "Hello! Who are you?"),
        ],
        "multi" => vec![
            m("system", "Be brief."),
            m("user", "Hi"),
            m("assistant", "Hello."),
            m("user", "Bye"),
        ],
        "user_only" => vec![m("user", "  padded  ")],
        other => panic!("unknown conversation {other}"),
    }
}

/// `text` with the date after "Current date: " (checked to be YYYY-MM-DD) replaced by `date`.
fn with_date(text: &str, date: &str) -> String {
    const KEY: &str = "Current date: ";
    let Some(at) = text.find(KEY) else {
        return text.to_string();
    };
    let start = at + KEY.len();
    let d = &text[start..start + 10];
    let digits = |r: std::ops::Range<usize>| d[r].bytes().all(|b| b.is_ascii_digit());
    assert!(
        digits(0..4) && &d[4..5] == "-" && digits(5..7) && &d[7..8] == "-" && digits(8..10),
        "not a date: {d}"
    );
    format!("{}{date}{}", &text[..start], &text[start + 10..])
}

#[test]
fn moe_family_templates_render_exactly_as_transformers() {
    for (src, bos, eos, expected) in FAMILIES {
        let expected: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(expected).unwrap();
        assert_eq!(expected.len(), 6);
        let t = ChatTemplate::with_tokens(src, bos, eos).unwrap();
        for (case, want) in &expected {
            let (conv, agp) = case.split_once('/').unwrap();
            let got = t.render(&conversation(conv), agp == "True").unwrap();
            assert_eq!(
                with_date(&got, "2026-01-02"),
                want.as_str().unwrap(),
                "{} / {case}",
                &src[..40.min(src.len())]
            );
        }
    }
}

/// The turn markers each family's model reads, where a conversation ends in a generation
/// prompt: harmony's assistant start, DeepSeek's assistant tag (non-thinking mode), GLM's,
/// Llama 4's assistant header.
#[test]
fn generation_prompts_end_in_each_familys_assistant_turn() {
    let ends = [
        "<|end|><|start|>assistant",
        "<｜Assistant｜><think></think>",
        "<|user|>\nBye<|assistant|>",
        "Bye<|eot|><|header_start|>assistant<|header_end|>\n\n",
    ];
    for ((src, bos, eos, _), end) in FAMILIES.into_iter().zip(ends) {
        let t = ChatTemplate::with_tokens(src, bos, eos).unwrap();
        let got = t.render(&conversation("multi"), true).unwrap();
        assert!(got.ends_with(end), "{got:?} does not end with {end:?}");
    }
}

//! Chat templates: real Qwen3, Qwen2 and Llama 3 templates rendered exactly as Hugging Face's
//! `transformers` (Jinja2 with `trim_blocks`/`lstrip_blocks`) renders them, the fallback, and
//! errors. The expected strings were produced by Jinja2 from the same template text.

use std::path::PathBuf;

use tessera_model::{ChatMessage, ChatTemplate, GgufFile, ModelError, Tokenizer};
/// The `chat_template` of Qwen/Qwen3 (tokenizer_config.json).
const QWEN3: &str = r##"{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in message.content %}
                {%- set content = message.content.split('</think>')[-1].lstrip('\n') %}
                {%- set reasoning_content = message.content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"##;
/// The `chat_template` of Qwen/Qwen2-Instruct.
const QWEN2: &str = r##"{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"##;
/// The `chat_template` of meta-llama/Meta-Llama-3-8B-Instruct.
const LLAMA3: &str = r##"{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"##;
fn conv(name: &str) -> Vec<ChatMessage> {
    let m = ChatMessage::new;
    match name {
        "sys_user" => vec![
            m("system", "You are a helpful assistant."),
            m("user", "Hello! Who are you?"),
        ],
        "multi" => vec![
            m("system", "Be brief."),
            m("user", "Hi"),
            m("assistant", "<think>\nhmm\n</think>\n\nHello."),
            m("user", "Bye"),
        ],
        "user_only" => vec![m("user", "  padded  ")],
        _ => unreachable!(),
    }
}

/// (template, conversation, add_generation_prompt, Jinja2's rendering).
const CASES: &[(&str, &str, bool, &str)] = &[
    ("qwen3", "sys_user", true, "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHello! Who are you?<|im_end|>\n<|im_start|>assistant\n"),
    ("qwen3", "sys_user", false, "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHello! Who are you?<|im_end|>\n"),
    ("qwen3", "multi", true, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"),
    ("qwen3", "multi", false, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"),
    ("qwen3", "user_only", true, "<|im_start|>user\n  padded  <|im_end|>\n<|im_start|>assistant\n"),
    ("qwen3", "user_only", false, "<|im_start|>user\n  padded  <|im_end|>\n"),
    ("qwen2", "sys_user", true, "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHello! Who are you?<|im_end|>\n<|im_start|>assistant\n"),
    ("qwen2", "sys_user", false, "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHello! Who are you?<|im_end|>\n"),
    ("qwen2", "multi", true, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\nhmm\n</think>\n\nHello.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"),
    ("qwen2", "multi", false, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\nhmm\n</think>\n\nHello.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"),
    ("qwen2", "user_only", true, "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n  padded  <|im_end|>\n<|im_start|>assistant\n"),
    ("qwen2", "user_only", false, "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n  padded  <|im_end|>\n"),
    ("llama3", "sys_user", true, "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are a helpful assistant.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHello! Who are you?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"),
    ("llama3", "sys_user", false, "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are a helpful assistant.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHello! Who are you?<|eot_id|>"),
    ("llama3", "multi", true, "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n<think>\nhmm\n</think>\n\nHello.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"),
    ("llama3", "multi", false, "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n<think>\nhmm\n</think>\n\nHello.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>"),
    ("llama3", "user_only", true, "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\npadded<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"),
    ("llama3", "user_only", false, "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\npadded<|eot_id|>"),
];

const TOJSON_SRC: &str = r#"{{ {"a": 1, "b": [1, 2.5, "x"], "c": {"d": none, "e": true}} | tojson }}|{{ "héllo \"q\"\n" | tojson }}|{{ [] | tojson }}|{{ {"k": [1]} | tojson(indent=2) }}"#;
const TOJSON_OUT: &str = "{\"a\": 1, \"b\": [1, 2.5, \"x\"], \"c\": {\"d\": null, \"e\": true}}|\"héllo \\\"q\\\"\\n\"|[]|{\n  \"k\": [\n    1\n  ]\n}";

fn stories() -> (GgufFile, Tokenizer) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/stories260K.gguf");
    let g = GgufFile::open(path).unwrap();
    let t = Tokenizer::from_gguf(&g).unwrap();
    (g, t)
}

fn chat_error<T: std::fmt::Debug>(r: Result<T, ModelError>) -> String {
    match r {
        Err(ModelError::ChatTemplate(msg)) => msg,
        other => panic!("expected a chat template error, got {other:?}"),
    }
}

#[test]
fn real_templates_render_exactly_as_jinja2() {
    for &(name, c, agp, expected) in CASES {
        let src = match name {
            "qwen3" => QWEN3,
            "qwen2" => QWEN2,
            "llama3" => LLAMA3,
            _ => unreachable!(),
        };
        let t = ChatTemplate::with_tokens(src, "<|begin_of_text|>", "<|eot_id|>").unwrap();
        assert!(!t.is_fallback());
        let got = t.render(&conv(c), agp).unwrap();
        assert_eq!(got, expected, "{name} / {c} / add_generation_prompt={agp}");
    }
}

#[test]
fn qwen3_system_and_user() {
    let t = ChatTemplate::with_tokens(QWEN3, "", "<|im_end|>").unwrap();
    let msgs = [
        ChatMessage::new("system", "You are terse."),
        ChatMessage::new("user", "Hi"),
    ];
    assert_eq!(
        t.render(&msgs, true).unwrap(),
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn tojson_matches_python_json_dumps() {
    let t = ChatTemplate::with_tokens(TOJSON_SRC, "", "").unwrap();
    assert_eq!(t.render(&[], false).unwrap(), TOJSON_OUT);
}

#[test]
fn raise_exception_and_bad_templates_are_errors() {
    let t = ChatTemplate::with_tokens(
        "{% if messages[0].role != 'user' %}{{ raise_exception('Conversation must start with user') }}{% endif %}ok",
        "",
        "",
    )
    .unwrap();
    assert_eq!(
        t.render(&[ChatMessage::new("user", "x")], true).unwrap(),
        "ok"
    );
    let msg = chat_error(t.render(&[ChatMessage::new("assistant", "x")], true));
    assert!(msg.contains("Conversation must start with user"), "{msg}");
    // Empty conversations do not panic, whatever the template does with them.
    let _ = t.render(&[], true);
    let _ = ChatTemplate::with_tokens(QWEN3, "", "")
        .unwrap()
        .render(&[], true);

    let msg = chat_error(ChatTemplate::with_tokens("{% for %}", "", ""));
    assert!(msg.contains("compile"), "{msg}");
}

#[test]
fn pycompat_methods_loop_controls_and_strftime() {
    let t = ChatTemplate::with_tokens(
        "{% for m in messages %}{% if m.content.startswith('skip') %}{% continue %}{% endif %}\
         [{{ m.content.strip().upper() }}|{{ m.content.split(',')|length }}]{% endfor %}\
         {{ strftime_now('%Y')|length }}",
        "",
        "",
    )
    .unwrap();
    let msgs = [
        ChatMessage::new("user", "  a,b  "),
        ChatMessage::new("user", "skip me"),
        ChatMessage::new("user", "c"),
    ];
    assert_eq!(t.render(&msgs, false).unwrap(), "[A,B|2][C|1]4");
}

#[test]
fn stories_has_no_template_and_gets_the_fallback() {
    let (g, tok) = stories();
    let t = ChatTemplate::from_gguf(&g, &tok).unwrap();
    assert!(t.is_fallback());
    let msgs = [
        ChatMessage::new("system", "You are terse."),
        ChatMessage::new("user", "Hi"),
    ];
    assert_eq!(
        t.render(&msgs, true).unwrap(),
        "system: You are terse.\nuser: Hi\nassistant:"
    );
    assert_eq!(
        t.render(&msgs, false).unwrap(),
        "system: You are terse.\nuser: Hi\n"
    );
    let ids = t.encode(&tok, &msgs, true).unwrap();
    assert_eq!(ids[0], 1);
    assert_eq!(
        tok.decode(&ids),
        " system: You are terse.\nuser: Hi\nassistant:"
    );
}

#[test]
fn encode_does_not_double_bos() {
    let (_, tok) = stories();
    let t = ChatTemplate::from_source(
        "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}{{ eos_token }}",
        &tok,
    )
    .unwrap();
    let msgs = [ChatMessage::new("user", "Once upon a time")];
    assert_eq!(t.render(&msgs, true).unwrap(), "<s>Once upon a time</s>");
    assert_eq!(
        t.encode(&tok, &msgs, true).unwrap(),
        vec![1, 403, 407, 261, 378, 2]
    );
}

#[test]
fn chat_template_is_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<ChatTemplate>();
}

#[test]
fn messages_round_trip_through_serde() {
    let m: Vec<ChatMessage> = serde_json::from_str(r#"[{"role":"user","content":"hi"}]"#).unwrap();
    assert_eq!(m, vec![ChatMessage::new("user", "hi")]);
    assert_eq!(
        serde_json::to_string(&m[0]).unwrap(),
        r#"{"role":"user","content":"hi"}"#
    );
}

/// A GGUF image with string metadata only (enough for a tokenizer and a template).
fn gguf_with(kvs: &[(&str, &[&str])]) -> Vec<u8> {
    let s = |out: &mut Vec<u8>, v: &str| {
        out.extend((v.len() as u64).to_le_bytes());
        out.extend(v.as_bytes());
    };
    let mut out = b"GGUF".to_vec();
    out.extend(3u32.to_le_bytes());
    out.extend(0u64.to_le_bytes());
    out.extend((kvs.len() as u64).to_le_bytes());
    for (k, v) in kvs {
        s(&mut out, k);
        if let [one] = v {
            out.extend(8u32.to_le_bytes());
            s(&mut out, one);
        } else {
            out.extend(9u32.to_le_bytes());
            out.extend(8u32.to_le_bytes());
            out.extend((v.len() as u64).to_le_bytes());
            for x in *v {
                s(&mut out, x);
            }
        }
    }
    out
}

#[test]
fn template_is_read_from_gguf_metadata() {
    let base: [(&str, &[&str]); 2] = [
        ("tokenizer.ggml.model", &["llama"]),
        ("tokenizer.ggml.tokens", &["<unk>", "▁a", "▁b"]),
    ];
    let mut kvs = base.to_vec();
    kvs.push(("tokenizer.chat_template", &[QWEN2]));
    let g = GgufFile::parse(&gguf_with(&kvs)).unwrap();
    let mut tok_kvs = base.to_vec();
    tok_kvs.push(("tokenizer.ggml.add_bos_token", &[]));
    // (add_bos_token is given as an empty string array here: not a bool, so an error.)
    let bad = Tokenizer::from_gguf(&GgufFile::parse(&gguf_with(&tok_kvs)).unwrap());
    assert!(matches!(bad, Err(ModelError::Tokenizer(m)) if m.contains("add_bos_token")));

    let tok = {
        let mut p = tessera_model::TokenizerParts::new(
            tessera_model::TokenizerKind::Spm,
            vec!["<unk>".into(), "▁a".into()],
        );
        p.add_bos = false;
        Tokenizer::from_parts(p).unwrap()
    };
    let t = ChatTemplate::from_gguf(&g, &tok).unwrap();
    assert!(!t.is_fallback());
    assert_eq!(
        t.render(&[ChatMessage::new("user", "a")], true).unwrap(),
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\n"
    );

    kvs.pop();
    kvs.push(("tokenizer.chat_template", &["x", "y"]));
    let g = GgufFile::parse(&gguf_with(&kvs)).unwrap();
    let msg = chat_error(ChatTemplate::from_gguf(&g, &tok));
    assert!(msg.contains("tokenizer.chat_template"), "{msg}");
}

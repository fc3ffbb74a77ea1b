//! Constrained decoding, as the gateway uses it: the grammar engine lives in
//! [`tessera_grammar`] (the cluster's sampling stage needs it too); the served model keeps one
//! compiler over its vocabulary ([`tessera_api::ServedModel::grammar_compiler`]).

pub use tessera_grammar::{
    check, choose, compact, Grammar, GrammarCompiler, GrammarError, GrammarLimits, GrammarSpec,
};

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;
    use tessera_model::{GgufFile, Tokenizer};

    fn tokenizer() -> Tokenizer {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../models/stories260K.gguf");
        Tokenizer::from_gguf(&GgufFile::open(path).unwrap()).unwrap()
    }

    /// Greedy decoding over made-up logits under `g`; the text produced.
    fn decode(tok: &Tokenizer, g: &mut Grammar, salt: u32) -> String {
        let mut out = Vec::new();
        for step in 0..300u32 {
            let mut logits: Vec<f32> = (0..tok.vocab_size())
                .map(|i| (((i as u32).wrapping_mul(2_654_435_761) ^ step ^ salt) % 1000) as f32)
                .collect();
            g.mask(&mut logits).unwrap();
            let t = tessera_sampling::argmax(&logits) as u32;
            if tok.is_end_of_generation(t) {
                break;
            }
            g.accept(t).unwrap();
            out.push(t);
            if g.is_finished() {
                break;
            }
        }
        tok.decode(&out)
    }

    /// Parameters with their own `$defs` (as Pydantic writes nested models) compile once
    /// nested in the call object, and the referenced definition constrains the arguments.
    #[test]
    fn tool_parameters_with_definitions_compile_as_calls() {
        use crate::openai::tools::{parse_tools, tool_grammar, ToolChoice, ToolFormat};
        let tok = tokenizer();
        let c = GrammarCompiler::new(&tok).unwrap();
        let tools = parse_tools(&serde_json::json!([
            {"type": "function", "function": {"name": "book", "parameters": {
                "$defs": {"City": {"enum": ["Paris", "Rome"]}},
                "type": "object", "properties": {"city": {"$ref": "#/$defs/City"}},
                "required": ["city"], "additionalProperties": false}}},
            {"type": "function", "function": {"name": "noop"}}
        ]))
        .unwrap();
        for choice in [ToolChoice::Required, ToolChoice::Named("book".into())] {
            let spec = tool_grammar(&tools, &choice, false, ToolFormat::Hermes).unwrap();
            let mut g = c.compile(&spec).unwrap();
            let text = decode(&tok, &mut g, 7);
            assert!(text.contains("<tool_call>"), "{text:?}");
            if text.contains("\"book\"") {
                assert!(text.contains("Paris") || text.contains("Rome"), "{text:?}");
            }
        }
    }

    #[test]
    fn a_forced_tool_call_parses_back_into_a_valid_call() {
        use crate::openai::tools::{
            parse_tools, tool_grammar, ToolCallParser, ToolChoice, ToolEvent, ToolFormat,
        };
        let tok = tokenizer();
        let c = GrammarCompiler::new(&tok).unwrap();
        let tools = parse_tools(&serde_json::json!([
            {"type": "function", "function": {"name": "get_weather", "parameters": {
                "type": "object",
                "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                "required": ["city", "days"], "additionalProperties": false}}},
            {"type": "function", "function": {"name": "noop"}}
        ]))
        .unwrap();
        for (choice, parallel) in [
            (ToolChoice::Required, true),
            (ToolChoice::Named("get_weather".into()), false),
        ] {
            let spec = tool_grammar(&tools, &choice, parallel, ToolFormat::Hermes).unwrap();
            let mut g = c.compile(&spec).unwrap();
            let text = decode(&tok, &mut g, 7);
            let mut p = ToolCallParser::new(ToolFormat::Hermes, &tools);
            let mut events = p.push(&text);
            events.extend(p.finish());
            assert!(!events.is_empty(), "{text:?}");
            for e in &events {
                let ToolEvent::Call(call) = e else {
                    panic!("not a call: {e:?} in {text:?}");
                };
                let args: Value = serde_json::from_str(&call.arguments).unwrap();
                if call.name == "get_weather" {
                    assert!(args["city"] == "Paris" || args["city"] == "Rome", "{args}");
                    assert!((1..=7).contains(&args["days"].as_i64().unwrap()), "{args}");
                }
            }
        }
    }
}

//! Bounds on a grammar before it reaches llguidance.
//!
//! A grammar is client input, and llguidance compiles it recursively: a chain of a few hundred
//! `$ref`s overflowed a thread's stack and aborted the whole process (on `serve`, and on every
//! node of a ring in turn, as failover re-sent it). So every spec is measured here first, by a
//! walk whose own depth is capped by the limit it checks, and refused with the limit it breaks
//! named; only a spec within every limit is compiled (on a thread with a large stack, under a
//! time budget: `GrammarCompiler::compile`).
//!
//! What is measured:
//! - the spec's size in bytes (a lark grammar's source; a schema's JSON);
//! - a schema's nesting depth *through its `$ref`s*: the stack llguidance needs grows with it;
//! - the number of subschemas, of definitions, of values in one `enum`, and a `pattern`'s length;
//! - in a lark grammar, the nesting of its brackets, and every schema it embeds with `%json`.

use serde_json::Value;
use std::collections::{HashMap, HashSet};

use crate::{GrammarError, GrammarSpec};

/// The limits every front end's grammars are held to (a node applies the same ones to the
/// grammars a ring carries to it). Generous for real schemas — a Pydantic model nests a few
/// levels, a tool list is tens of tools — and far below what exhausts a compile.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GrammarLimits {
    /// Bytes of a spec: a lark grammar's source, or a schema's JSON.
    pub max_bytes: usize,
    /// Nesting of a schema, counting each `$ref` followed as one more level.
    pub max_depth: usize,
    /// Subschemas (JSON objects and arrays) in one spec, embedded schemas together.
    pub max_nodes: usize,
    /// Entries of `$defs` and `definitions`, all levels together.
    pub max_definitions: usize,
    /// Values of one `enum`.
    pub max_enum_values: usize,
    /// Bytes of one `pattern` (or `patternProperties` key).
    pub max_pattern_bytes: usize,
    /// Nesting of brackets in a lark grammar's source.
    pub max_lark_nesting: usize,
    /// Symbols of the compiled grammar (llguidance's own count), checked while compiling.
    pub max_grammar_symbols: usize,
}

impl GrammarLimits {
    /// The one table (see `tessera_gateway::limits` for the request limits around it).
    pub const DEFAULT: Self = Self {
        max_bytes: 256 * 1024,
        max_depth: 64,
        max_nodes: 20_000,
        max_definitions: 1_000,
        max_enum_values: 4_096,
        max_pattern_bytes: 4 * 1024,
        max_lark_nesting: 64,
        max_grammar_symbols: 200_000,
    };
}

impl Default for GrammarLimits {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// A limit a grammar broke: which one, the most it allows, and how far the spec got before the
/// check stopped (at least `max + 1`; the walk stops at the first excess).
fn exceeded(limit: &'static str, max: usize, found: usize) -> GrammarError {
    GrammarError::Limit { limit, max, found }
}

/// Checks `spec` against `limits`; `Ok` means it may be compiled.
pub fn check(spec: &GrammarSpec, limits: &GrammarLimits) -> Result<(), GrammarError> {
    match spec {
        GrammarSpec::JsonSchema(schema) => {
            let bytes = json_size(schema, limits.max_bytes);
            if bytes > limits.max_bytes {
                return Err(exceeded("grammar_bytes", limits.max_bytes, bytes));
            }
            SchemaWalk::new(schema, limits).run().map(|_| ())
        }
        GrammarSpec::Lark(src) => {
            if src.len() > limits.max_bytes {
                return Err(exceeded("grammar_bytes", limits.max_bytes, src.len()));
            }
            check_lark(src, limits)
        }
    }
}

/// The bytes of `v` as compact JSON (what `serde_json::to_string` writes), counted without
/// building the string and stopping early once past `cap`. It keeps its own stack: a value
/// built in code may nest deeper than serde's parser (or its serializer's recursion) allows.
pub fn json_size(v: &Value, cap: usize) -> usize {
    let mut total = 0usize;
    let mut stack = vec![v];
    while let Some(v) = stack.pop() {
        total += match v {
            Value::Null => 4,
            Value::Bool(b) => 4 + usize::from(!b),
            Value::Number(n) => n.to_string().len(),
            Value::String(s) => string_size(s),
            Value::Array(a) => {
                stack.extend(a.iter());
                2 + a.len().saturating_sub(1)
            }
            Value::Object(o) => {
                stack.extend(o.values());
                let keys: usize = o.keys().map(|k| string_size(k) + 1).sum();
                2 + keys + o.len().saturating_sub(1)
            }
        };
        if total > cap {
            break;
        }
    }
    total
}

/// A JSON string's bytes, quotes and escapes included.
fn string_size(s: &str) -> usize {
    let escaped: usize = s
        .bytes()
        .map(|b| match b {
            b'"' | b'\\' | b'\n' | b'\r' | b'\t' | 0x08 | 0x0c => 2,
            0..=0x1f => 6,
            _ => 1,
        })
        .sum();
    2 + escaped
}

/// The depth walk over one schema: structural nesting plus `$ref`s followed, memoized per
/// target so a DAG of references costs its size, not its paths; a reference back into a
/// target being walked (recursion, which llguidance compiles lazily) adds nothing.
struct SchemaWalk<'a> {
    root: &'a Value,
    limits: &'a GrammarLimits,
    /// Depth below each `$ref` target already measured, by address.
    done: HashMap<*const Value, usize>,
    /// Targets on the current path.
    open: HashSet<*const Value>,
    nodes: usize,
    definitions: usize,
}

impl<'a> SchemaWalk<'a> {
    fn new(root: &'a Value, limits: &'a GrammarLimits) -> Self {
        Self {
            root,
            limits,
            done: HashMap::new(),
            open: HashSet::new(),
            nodes: 0,
            definitions: 0,
        }
    }

    /// Continues a count of subschemas begun on other schemas of the same grammar.
    fn counting_from(mut self, nodes: usize) -> Self {
        self.nodes = nodes;
        self
    }

    /// Walks the whole schema; the subschemas counted so far.
    fn run(mut self) -> Result<usize, GrammarError> {
        let root = self.root;
        self.depth(root, 0)?;
        Ok(self.nodes)
    }

    /// How deep `v` nests below itself. `above` is the depth already on the path: the walk
    /// refuses as soon as the total passes the limit, so its own recursion stays within it.
    fn depth(&mut self, v: &'a Value, above: usize) -> Result<usize, GrammarError> {
        if above > self.limits.max_depth {
            return Err(exceeded("schema_depth", self.limits.max_depth, above));
        }
        let children: Vec<&'a Value> = match v {
            Value::Array(a) => a.iter().collect(),
            Value::Object(o) => {
                self.visit_object(o)?;
                o.values().collect()
            }
            _ => return Ok(0),
        };
        self.nodes += 1;
        if self.nodes > self.limits.max_nodes {
            return Err(exceeded("schema_nodes", self.limits.max_nodes, self.nodes));
        }
        let mut deepest = 0;
        if let Some(target) = v
            .get("$ref")
            .and_then(Value::as_str)
            .and_then(|r| self.resolve(r))
        {
            deepest = self.through_ref(target, above)?;
        }
        for c in children {
            if c.is_object() || c.is_array() {
                deepest = deepest.max(1 + self.depth(c, above + 1)?);
            }
        }
        Ok(deepest)
    }

    /// The depth a `$ref` to `target` adds at `above`.
    fn through_ref(&mut self, target: &'a Value, above: usize) -> Result<usize, GrammarError> {
        let key = target as *const Value;
        if let Some(&d) = self.done.get(&key) {
            if above + 1 + d > self.limits.max_depth {
                return Err(exceeded(
                    "schema_depth",
                    self.limits.max_depth,
                    above + 1 + d,
                ));
            }
            return Ok(1 + d);
        }
        if !self.open.insert(key) {
            return Ok(0);
        }
        let d = self.depth(target, above + 1)?;
        self.open.remove(&key);
        self.done.insert(key, d);
        Ok(1 + d)
    }

    /// The per-object limits: definitions, `enum` values, pattern bytes.
    fn visit_object(&mut self, o: &serde_json::Map<String, Value>) -> Result<(), GrammarError> {
        let l = self.limits;
        for key in ["$defs", "definitions"] {
            if let Some(Value::Object(defs)) = o.get(key) {
                self.definitions += defs.len();
                if self.definitions > l.max_definitions {
                    return Err(exceeded(
                        "schema_definitions",
                        l.max_definitions,
                        self.definitions,
                    ));
                }
            }
        }
        if let Some(Value::Array(values)) = o.get("enum") {
            if values.len() > l.max_enum_values {
                return Err(exceeded("enum_values", l.max_enum_values, values.len()));
            }
        }
        let patterns = o.get("pattern").and_then(Value::as_str).into_iter().chain(
            o.get("patternProperties")
                .and_then(Value::as_object)
                .into_iter()
                .flat_map(|p| p.keys().map(String::as_str)),
        );
        for p in patterns {
            if p.len() > l.max_pattern_bytes {
                return Err(exceeded("pattern_bytes", l.max_pattern_bytes, p.len()));
            }
        }
        Ok(())
    }

    /// A local reference (`#`, `#/…` as a JSON pointer) in the root document; other forms
    /// are left to llguidance, which refuses what it cannot resolve.
    fn resolve(&self, reference: &str) -> Option<&'a Value> {
        let pointer = reference.strip_prefix('#')?;
        let decoded = percent_decode(pointer);
        self.root.pointer(&decoded)
    }
}

/// `%xx` escapes in a reference's fragment (JSON Schema references are URIs).
fn percent_decode(s: &str) -> String {
    if !s.contains('%') {
        return s.to_string();
    }
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            if let (Some(h), Some(l)) = (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A lark grammar: its bracket nesting, and each schema it embeds after `%json`.
fn check_lark(src: &str, limits: &GrammarLimits) -> Result<(), GrammarError> {
    let mut depth = 0usize;
    let mut quote: Option<char> = None;
    let mut escaped = false;
    for c in src.chars() {
        if let Some(q) = quote {
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == q {
                quote = None;
            }
            continue;
        }
        match c {
            '"' | '/' => quote = Some(c),
            '(' | '[' => {
                depth += 1;
                if depth > limits.max_lark_nesting {
                    return Err(exceeded("lark_nesting", limits.max_lark_nesting, depth));
                }
            }
            ')' | ']' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    // Embedded schemas share one count of subschemas: a tool list is one grammar.
    let mut nodes = 0;
    for (at, _) in src.match_indices("%json") {
        let rest = src[at + "%json".len()..].trim_start();
        let mut values = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
        if let Some(Ok(schema)) = values.next() {
            nodes = SchemaWalk::new(&schema, limits)
                .counting_from(nodes)
                .run()?;
        }
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use serde_json::json;

    fn limit_of(spec: &GrammarSpec) -> Option<&'static str> {
        match check(spec, &GrammarLimits::DEFAULT) {
            Ok(()) => None,
            Err(GrammarError::Limit { limit, .. }) => Some(limit),
            Err(e) => panic!("not a limit: {e}"),
        }
    }

    /// `$defs` d0 → d1 → … → d{n-1}: shallow as JSON, `n` deep as llguidance compiles it.
    pub(crate) fn ref_chain(n: usize) -> Value {
        let mut defs = serde_json::Map::new();
        for i in 0..n {
            let next = if i + 1 < n {
                json!({"type": "object", "properties": {"x": {"$ref": format!("#/$defs/d{}", i + 1)}}})
            } else {
                json!({"type": "integer"})
            };
            defs.insert(format!("d{i}"), next);
        }
        json!({"$defs": defs, "$ref": "#/$defs/d0"})
    }

    #[test]
    fn json_size_is_what_serde_writes() {
        let v = json!({"a\"b": [1, 2.5, -3e40, null, true, false, "x\n\u{1}\\é"], "": {}, "e": []});
        assert_eq!(
            json_size(&v, usize::MAX),
            serde_json::to_string(&v).unwrap().len()
        );
    }

    #[test]
    fn a_chain_of_references_is_as_deep_as_it_is_long() {
        assert_eq!(limit_of(&GrammarSpec::JsonSchema(ref_chain(10))), None);
        assert_eq!(
            limit_of(&GrammarSpec::JsonSchema(ref_chain(300))),
            Some("schema_depth")
        );
    }

    #[test]
    fn recursion_through_a_reference_is_allowed() {
        let tree = json!({
            "$defs": {"node": {"type": "object", "properties": {
                "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
            "$ref": "#/$defs/node"
        });
        assert_eq!(limit_of(&GrammarSpec::JsonSchema(tree)), None);
    }

    /// Each definition referring to the next one twice: 2^n paths, one walk each target.
    #[test]
    fn shared_references_are_measured_once() {
        let mut defs = serde_json::Map::new();
        for i in 0..40 {
            let r = json!({"$ref": format!("#/$defs/d{}", i + 1)});
            defs.insert(format!("d{i}"), json!({"anyOf": [r.clone(), r]}));
        }
        defs.insert("d40".into(), json!({"type": "null"}));
        let s = json!({"$defs": defs, "$ref": "#/$defs/d0"});
        // 40 levels of anyOf → array → ref: deep, refused, and quickly (memoized).
        assert_eq!(limit_of(&GrammarSpec::JsonSchema(s)), Some("schema_depth"));
    }

    #[test]
    fn each_limit_is_named() {
        let mut deep = json!({"type": "string"});
        for _ in 0..100 {
            deep = json!({"type": "array", "items": deep});
        }
        assert_eq!(
            limit_of(&GrammarSpec::JsonSchema(deep)),
            Some("schema_depth")
        );
        let big_enum = json!({"enum": (0..5000).collect::<Vec<_>>()});
        assert_eq!(
            limit_of(&GrammarSpec::JsonSchema(big_enum)),
            Some("enum_values")
        );
        let pattern = json!({"type": "string", "pattern": "a".repeat(5000)});
        assert_eq!(
            limit_of(&GrammarSpec::JsonSchema(pattern)),
            Some("pattern_bytes")
        );
        let defs: serde_json::Map<String, Value> = (0..1001)
            .map(|i| (format!("d{i}"), json!({"type": "null"})))
            .collect();
        assert_eq!(
            limit_of(&GrammarSpec::JsonSchema(json!({"$defs": defs}))),
            Some("schema_definitions")
        );
        let huge = json!({"description": "x".repeat(300 * 1024)});
        assert_eq!(
            limit_of(&GrammarSpec::JsonSchema(huge)),
            Some("grammar_bytes")
        );
        let wide = json!({"anyOf": vec![json!({}); 25_000]});
        assert_eq!(
            limit_of(&GrammarSpec::JsonSchema(wide)),
            Some("schema_nodes")
        );
    }

    #[test]
    fn lark_nesting_and_embedded_schemas_are_checked() {
        let nested = format!("start: {}\"a\"{}", "(".repeat(100), ")".repeat(100));
        assert_eq!(limit_of(&GrammarSpec::Lark(nested)), Some("lark_nesting"));
        let quoted = format!("start: \"{}\"", "(".repeat(100));
        assert_eq!(limit_of(&GrammarSpec::Lark(quoted)), None);
        let embedded = format!("start: %json {}\n", ref_chain(300));
        assert_eq!(limit_of(&GrammarSpec::Lark(embedded)), Some("schema_depth"));
        let fine = format!("start: %json {}\n", ref_chain(5));
        assert_eq!(limit_of(&GrammarSpec::Lark(fine)), None);
    }
}

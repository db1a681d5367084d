//! The layer rule of `docs/ARCHITECTURE.md`: the KV bookkeeping (`kv`), the scheduler and the
//! conversation state move ids and tokens only. They depend on no candle (or tokenizers, or
//! CUDA) type and on nothing of the model, the attention op, the engine or the service, even
//! through another module: so they unit-test without a model and the tiers below host can grow
//! there.
//!
//! Checked on the crate's real module graph: every file under `src/` is parsed (`syn`), every
//! `use` (grouped, renamed, glob) and every path in code is resolved (`crate::`, `super::`,
//! `self::`, imported names, re-exports followed to where they point) to the module it names;
//! the modules the layer reaches, directly or through others, must stay inside the rule.
//!
//! That the service and the server use nothing a dependent could not name is
//! `tests/back_channels.rs`.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use syn::visit::Visit;

#[path = "common/sources.rs"]
mod sources;

use sources::{crate_sources, module_path};

/// The layer, as module paths (each with everything under it).
const LAYER: [&str; 4] = [
    "crate::kv",
    "crate::scheduler",
    "crate::conversation",
    "crate::persist",
];

/// Modules the layer must not reach.
const ABOVE: [&str; 6] = [
    "crate::model",
    "crate::attention",
    "crate::engine",
    "crate::service",
    "crate::cli",
    "crate::server",
];

/// Crates the layer must not reach.
const TENSORS: [&str; 5] = [
    "candle_core",
    "candle_nn",
    "candle_transformers",
    "tokenizers",
    "cudarc",
];

/// One module: what its `use`s name, and what it refers to.
#[derive(Default, Debug)]
struct Module {
    /// Names brought in by `use` (or `pub use`), with the absolute path each stands for.
    aliases: BTreeMap<String, Vec<String>>,
    /// Paths it refers to, absolute where they could be resolved.
    refs: Vec<Vec<String>>,
    /// Its child modules' names.
    children: BTreeSet<String>,
}

/// The module graph of a crate given as (file path under `src/`, source) pairs.
#[derive(Default, Debug)]
struct Graph {
    modules: BTreeMap<String, Module>,
}

/// Collects the raw paths of one module's code (resolved later, once every `use` is known).
struct Collector<'g> {
    graph: &'g mut Graph,
    module: Vec<String>,
    /// Raw paths per module, before resolution.
    raw: &'g mut Vec<(Vec<String>, Vec<String>)>,
}

impl Collector<'_> {
    fn module(&mut self) -> &mut Module {
        self.graph
            .modules
            .entry(self.module.join("::"))
            .or_default()
    }

    fn use_tree(&mut self, prefix: &mut Vec<String>, tree: &syn::UseTree) {
        match tree {
            syn::UseTree::Path(p) => {
                prefix.push(p.ident.to_string());
                self.use_tree(prefix, &p.tree);
                prefix.pop();
            }
            syn::UseTree::Name(n) => self.alias(prefix, &n.ident.to_string(), &n.ident.to_string()),
            syn::UseTree::Rename(r) => {
                self.alias(prefix, &r.ident.to_string(), &r.rename.to_string())
            }
            syn::UseTree::Glob(_) => self.raw.push((self.module.clone(), prefix.clone())),
            syn::UseTree::Group(g) => g.items.iter().for_each(|t| self.use_tree(prefix, t)),
        }
    }

    fn alias(&mut self, prefix: &[String], name: &str, as_name: &str) {
        let mut path = prefix.to_vec();
        if name != "self" {
            path.push(name.to_string());
        }
        let as_name = match as_name {
            "self" => prefix.last().cloned().unwrap_or_default(),
            other => other.to_string(),
        };
        self.raw.push((self.module.clone(), path.clone()));
        self.module().aliases.insert(as_name, path);
    }
}

impl<'ast> Visit<'ast> for Collector<'_> {
    fn visit_item_mod(&mut self, m: &'ast syn::ItemMod) {
        let name = m.ident.to_string();
        self.module().children.insert(name.clone());
        if let Some((_, items)) = &m.content {
            self.module.push(name);
            self.module();
            items.iter().for_each(|i| self.visit_item(i));
            self.module.pop();
        }
    }

    fn visit_item_use(&mut self, u: &'ast syn::ItemUse) {
        self.use_tree(&mut Vec::new(), &u.tree);
    }

    fn visit_path(&mut self, p: &'ast syn::Path) {
        let segments = p.segments.iter().map(|s| s.ident.to_string()).collect();
        self.raw.push((self.module.clone(), segments));
        syn::visit::visit_path(self, p);
    }
}

impl Graph {
    fn parse(files: &[(String, String)]) -> Self {
        let mut graph = Graph::default();
        let mut raw = Vec::new();
        for (file, source) in files {
            let module = module_path(file);
            let ast = syn::parse_file(source).unwrap_or_else(|e| panic!("{file}: {e}"));
            let mut c = Collector {
                graph: &mut graph,
                module,
                raw: &mut raw,
            };
            c.module();
            c.visit_file(&ast);
        }
        for (module, path) in raw {
            if let Some(abs) = graph.absolute(&module, &path) {
                let key = module.join("::");
                graph.modules.entry(key).or_default().refs.push(abs);
            }
        }
        graph
    }

    /// `path` as written in `module`, made absolute; `None` for what is not the crate's nor a
    /// watched crate's (std, local names, generics).
    fn absolute(&self, module: &[String], path: &[String]) -> Option<Vec<String>> {
        let (first, rest) = path.split_first()?;
        let mut base: Vec<String> = match first.as_str() {
            "crate" => vec!["crate".into()],
            "self" => module.to_vec(),
            "super" => {
                let mut m = module.to_vec();
                m.pop();
                let mut rest = rest;
                while rest.first().map(String::as_str) == Some("super") {
                    m.pop();
                    rest = &rest[1..];
                }
                return Some(m.into_iter().chain(rest.iter().cloned()).collect());
            }
            name if TENSORS.contains(&name) => vec![name.to_string()],
            name => {
                let here = self.modules.get(&module.join("::"))?;
                match here.aliases.get(name) {
                    // An alias of itself would loop: the name is the external crate's.
                    Some(target) if target.as_slice() != [name.to_string()] => {
                        return self.absolute(module, &[target.clone(), rest.to_vec()].concat());
                    }
                    _ if here.children.contains(name) => {
                        module.iter().cloned().chain([name.to_string()]).collect()
                    }
                    _ => return None,
                }
            }
        };
        base.extend(rest.iter().cloned());
        Some(base)
    }

    /// The module `path` lands in, following re-exports; or the watched crate it names.
    fn target(&self, path: &[String]) -> Option<String> {
        let mut path = path.to_vec();
        for _ in 0..32 {
            if TENSORS.contains(&path[0].as_str()) {
                return Some(path[0].clone());
            }
            let mut n = path.len();
            while n > 0 && !self.modules.contains_key(&path[..n].join("::")) {
                n -= 1;
            }
            let module = path[..n].join("::");
            let alias = (path.get(n)).and_then(|name| self.modules.get(&module)?.aliases.get(name));
            match alias {
                Some(target) => {
                    let m: Vec<String> = module.split("::").map(str::to_string).collect();
                    let target = self.absolute(&m, target)?;
                    path = [target, path[n + 1..].to_vec()].concat();
                }
                None => return (n > 0).then_some(module),
            }
        }
        None
    }

    /// The modules (and watched crates) each module depends on. The crate root is only a
    /// place of re-exports, followed by [`Graph::target`]: it depends on nothing itself.
    fn edges(&self) -> BTreeMap<String, BTreeSet<String>> {
        (self.modules.iter())
            .filter(|(name, _)| name.as_str() != "crate")
            .map(|(name, m)| {
                let to = (m.refs.iter())
                    .filter_map(|r| self.target(r))
                    .filter(|t| t != name && t != "crate")
                    .collect();
                (name.clone(), to)
            })
            .collect()
    }

    /// Every way out of the layer: the chain of modules from the layer to what it must not
    /// reach.
    fn breaches(&self) -> Vec<String> {
        self.breaches_of(&LAYER, &ABOVE, &TENSORS)
    }

    /// The chains by which modules under `layer` reach a module under `above` or a crate of
    /// `crates`.
    fn breaches_of(&self, layer: &[&str], above: &[&str], crates: &[&str]) -> Vec<String> {
        let edges = self.edges();
        let within = |m: &str, roots: &[&str]| {
            roots
                .iter()
                .any(|r| m == *r || m.starts_with(&format!("{r}::")))
        };
        let mut parent: BTreeMap<String, String> = BTreeMap::new();
        let mut queue: VecDeque<String> = (self.modules.keys())
            .filter(|m| within(m, layer))
            .cloned()
            .collect();
        let mut seen: BTreeSet<String> = queue.iter().cloned().collect();
        let mut out = Vec::new();
        while let Some(m) = queue.pop_front() {
            if within(&m, above) || crates.contains(&m.as_str()) {
                let mut chain = vec![m.clone()];
                while let Some(p) = parent.get(chain.last().unwrap()) {
                    chain.push(p.clone());
                }
                chain.reverse();
                out.push(chain.join(" -> "));
                continue;
            }
            for next in edges.get(&m).into_iter().flatten() {
                if seen.insert(next.clone()) {
                    parent.insert(next.clone(), m.clone());
                    queue.push_back(next.clone());
                }
            }
        }
        out
    }
}

#[test]
fn kv_scheduler_and_conversations_reach_no_tensor_or_model_module() {
    let graph = Graph::parse(&crate_sources());
    for m in [
        "crate::kv::cache::arena",
        "crate::scheduler",
        "crate::conversation",
        "crate::persist",
    ] {
        assert!(graph.modules.contains_key(m), "{m} not found in the crate");
    }
    // The layer does reach the modules it is allowed to.
    let edges = graph.edges();
    assert!(
        edges["crate::scheduler"].contains("crate::kv::cache"),
        "{:?}",
        edges["crate::scheduler"]
    );
    assert!(edges["crate::conversation"].contains("crate::message"));
    let breaches = graph.breaches();
    assert!(
        breaches.is_empty(),
        "layer rule broken:\n{}",
        breaches.join("\n")
    );
}

/// The attention op sits below the model: it reaches nothing of it, nor of what runs it,
/// even through another module (the CPU's vector paths are `crate::cpu`'s, the MLP's
/// activations `crate::math`'s).
#[test]
fn the_attention_op_reaches_no_model_module() {
    let graph = Graph::parse(&crate_sources());
    assert!(graph.modules.contains_key("crate::attention::cpu"));
    let above = [
        "crate::model",
        "crate::engine",
        "crate::service",
        "crate::server",
    ];
    assert_below(&graph, "crate::attention", &above);
}

/// Fails naming each chain by which `layer` reaches a module under one of `above`.
fn assert_below(graph: &Graph, layer: &str, above: &[&str]) {
    let breaches = graph.breaches_of(&[layer], above, &[]);
    assert!(
        breaches.is_empty(),
        "{layer} reaches up:\n{}",
        breaches.join("\n")
    );
}

/// Chat text sits beside the model, not inside it: templates, tool calls, reasoning and
/// grammars reach nothing of the numeric model (weights, kernels, the graph), the engine or
/// what serves it; the grammar reads the vocabulary it is handed. (The tensor crates are not
/// checked: the crate's `Error`, which every module returns, carries candle's.)
#[test]
fn chat_text_reaches_no_model_module() {
    let graph = Graph::parse(&crate_sources());
    assert!(graph.modules.contains_key("crate::chat::template"));
    let above = [
        "crate::model",
        "crate::attention",
        "crate::engine",
        "crate::service",
        "crate::server",
    ];
    assert_below(&graph, "crate::chat", &above);
}

/// The leaks the old substring check missed: grouped and renamed imports, a re-export at the
/// crate root, a module outside the layer that holds a model type, and `super::` paths.
#[test]
fn leaks_through_grouped_imports_re_exports_and_other_modules_are_found() {
    let files = |conversation: &str, util: &str| {
        [
            ("lib.rs", "mod conversation; mod scheduler; mod util; mod kv; mod message; pub mod model; pub use model::Tensorish;"),
            ("scheduler.rs", "use crate::{conversation::{Conversation}, util::{Wrapper}};"),
            ("conversation.rs", conversation),
            ("util.rs", util),
            ("model/mod.rs", "mod chat; pub use chat::{Message, Tensorish};"),
            ("model/chat.rs", "pub struct Message; pub type Tensorish = candle_core::Tensor;"),
            ("message.rs", "pub struct Message;"),
            ("kv/mod.rs", "mod cache;"),
            ("kv/cache.rs", "fn f() { let _ = super::super::message::Message; }"),
        ]
        .map(|(f, s)| (f.to_string(), s.to_string()))
    };
    let clean_util = "pub struct Wrapper(crate::message::Message);";
    let breaches = |conversation, util| Graph::parse(&files(conversation, util)).breaches();
    assert_eq!(
        breaches("use crate::{model::{Message as M}};", clean_util),
        ["crate::conversation -> crate::model::chat"]
    );
    assert_eq!(
        breaches("", "pub struct Wrapper(crate::model::Message);"),
        ["crate::scheduler -> crate::util -> crate::model::chat"]
    );
    assert_eq!(
        breaches("fn f() -> crate::Tensorish { todo!() }", clean_util),
        ["crate::conversation -> crate::model::chat"]
    );
    assert_eq!(
        breaches("", "pub struct Wrapper(candle_core::Tensor);"),
        ["crate::scheduler -> crate::util -> candle_core"]
    );
    assert_eq!(
        breaches("use crate::message::Message;", clean_util),
        Vec::<String>::new()
    );
}

/// What docs/ARCHITECTURE.md says each module depends on ("Dependencies point one way: `a` →
/// `b`, `c`; ..."), as (module, the modules it names), from the document itself.
fn documented_dependencies() -> Vec<(String, BTreeSet<String>)> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/ARCHITECTURE.md");
    let doc = std::fs::read_to_string(path).unwrap();
    let lead = "Dependencies point one way:";
    let start = doc.find(lead).expect("the dependency sentence") + lead.len();
    // To the first full stop, leaving out remarks in parentheses (they name types, not
    // modules).
    let mut bare = String::new();
    let mut depth = 0;
    let mut chars = doc[start..].chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            '.' if depth == 0 && chars.peek().is_none_or(|n| n.is_whitespace()) => break,
            c if depth == 0 => bare.push(c),
            _ => {}
        }
    }
    let names = |s: &str| -> Vec<String> {
        s.split('`')
            .skip(1)
            .step_by(2)
            .map(str::to_string)
            .collect()
    };
    bare.split(';')
        .map(|clause| {
            let (from, to) = clause.split_once('→').expect("`a` → `b`, ...");
            let from = names(from);
            assert_eq!(from.len(), 1, "{clause}");
            (from[0].clone(), names(to).into_iter().collect())
        })
        .collect()
}

/// The crate's top-level modules each top-level module depends on (any of its modules on any
/// of theirs).
fn top_level_dependencies(graph: &Graph) -> BTreeMap<String, BTreeSet<String>> {
    let top = |m: &str| {
        m.strip_prefix("crate::")
            .map(|r| r.split("::").next().unwrap_or(r).to_string())
    };
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (from, to) in graph.edges() {
        let Some(from) = top(&from) else { continue };
        let deps = out.entry(from.clone()).or_default();
        // Every module returns the crate's `Error`: the document says so once, not per module.
        let named = to.iter().filter_map(|t| top(t));
        deps.extend(named.filter(|t| *t != from && t != "error"));
    }
    out
}

/// docs/ARCHITECTURE.md's dependency sentence is the code's: each module it names depends on
/// exactly the modules it lists, so the document cannot drift from the code.
#[test]
fn the_architecture_s_dependency_sentence_is_the_code_s() {
    let graph = Graph::parse(&crate_sources());
    let actual = top_level_dependencies(&graph);
    let documented = documented_dependencies();
    assert!(documented.len() >= 6, "{documented:?}");
    let wrong: Vec<String> = documented
        .iter()
        .filter(|(m, deps)| actual.get(m) != Some(deps))
        .map(|(m, deps)| format!("`{m}`: documented {deps:?}, the code's {:?}", actual.get(m)))
        .collect();
    assert!(
        wrong.is_empty(),
        "docs/ARCHITECTURE.md's dependency sentence is not the code's:\n{}",
        wrong.join("\n")
    );
}

//! The public API, listed from the source and compared with the committed `docs/public-api.txt`,
//! so that every change to it is a decision: a change of the API fails this test until the
//! list is rewritten (`PENSIEVE_BLESS_API=1 cargo test --release --test public_api`) and the
//! new list is committed with the change, where a reviewer sees it.
//!
//! What a dependent can name: every item of a module reached through `pub mod`s from the crate
//! root, and every `pub use` there (followed to the definition, wherever it lives); for each
//! type, its public fields, its variants, the `pub` functions of its inherent impls (in any
//! module: the engine's are spread over private ones), the traits it implements, and the
//! builder setters `setters!` makes. Items behind a feature say which.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use quote::ToTokens;

/// An item as the list shows it: the lines it contributes, under its public path.
#[derive(Clone, Debug, Default)]
struct Def {
    /// `struct`, `enum`, `fn`, ... with the attributes a dependent must know
    /// (`#[non_exhaustive]`), and the signature where it has one.
    head: String,
    /// Fields, variants or trait items, each a line after the path.
    members: Vec<String>,
    /// Whether it is a type (whose impls are listed with it).
    is_type: bool,
}

/// One module: its public child modules, its public items, its re-exports.
#[derive(Debug, Default)]
struct Module {
    /// Child modules declared `pub`, with the feature they need (if any).
    public_children: BTreeMap<String, Option<String>>,
    /// `pub` items by name, with the feature they need.
    items: BTreeMap<String, (Def, Option<String>)>,
    /// `pub use` names: the path each stands for, and the feature it needs.
    reexports: BTreeMap<String, (Vec<String>, Option<String>)>,
}

/// What every module of the crate declares, and the impls found anywhere.
#[derive(Debug, Default)]
struct Crate {
    modules: BTreeMap<String, Module>,
    /// By a type's name: `pub fn` signatures of its inherent impls and the traits it
    /// implements, with the feature they need.
    impls: BTreeMap<String, BTreeSet<String>>,
}

/// Tokens as one line, with the spaces the token printer puts everywhere taken out where Rust
/// is written without them.
fn tokens(t: &impl ToTokens) -> String {
    let mut s = t.to_token_stream().to_string();
    for (from, to) in [
        (" :: ", "::"),
        (":: ", "::"),
        (" ::", "::"),
        (" ,", ","),
        (",)", ")"),
        (" ;", ";"),
        ("< ", "<"),
        (" <", "<"),
        (" >", ">"),
        ("& ", "&"),
        (" (", "("),
        ("( ", "("),
        (" )", ")"),
        ("[ ", "["),
        (" ]", "]"),
        (" :", ":"),
        ("# [", "#["),
        ("! (", "!("),
        ("' ", "'"),
    ] {
        while s.contains(from) {
            s = s.replace(from, to);
        }
    }
    s.replace("->", " -> ").replace("  ", " ")
}

/// The feature an item's `#[cfg(feature = "...")]` needs; `Some("test")` for test-only code.
fn cfg_of(attrs: &[syn::Attribute]) -> Option<String> {
    attrs
        .iter()
        .filter(|a| a.path().is_ident("cfg"))
        .map(|a| tokens(&a.meta))
        .map(|m| {
            let m = m
                .trim_start_matches("cfg(")
                .trim_end_matches(')')
                .to_string();
            match m.as_str() {
                "test" | "doctest" => "test".to_string(),
                _ => m,
            }
        })
        .next()
}

fn non_exhaustive(attrs: &[syn::Attribute]) -> &'static str {
    match attrs.iter().any(|a| a.path().is_ident("non_exhaustive")) {
        true => "#[non_exhaustive] ",
        false => "",
    }
}

/// The feature under which `#[cfg_attr(feature = "...", visibility::make(pub))]` makes a
/// crate-private item public.
fn made_pub(attrs: &[syn::Attribute]) -> Option<String> {
    attrs
        .iter()
        .filter(|a| a.path().is_ident("cfg_attr"))
        .map(|a| tokens(&a.meta))
        .find(|m| m.contains("visibility::make(pub)"))
        .map(|m| {
            let m = m.trim_start_matches("cfg_attr(");
            m[..m.find(", visibility").unwrap_or(m.len())].to_string()
        })
}

fn is_pub(vis: &syn::Visibility) -> bool {
    matches!(vis, syn::Visibility::Public(_))
}

/// Flattens a `use` tree into (name, path) pairs.
fn use_paths(tree: &syn::UseTree, prefix: &mut Vec<String>, out: &mut Vec<(String, Vec<String>)>) {
    match tree {
        syn::UseTree::Path(p) => {
            prefix.push(p.ident.to_string());
            use_paths(&p.tree, prefix, out);
            prefix.pop();
        }
        syn::UseTree::Name(n) => {
            let mut path = prefix.clone();
            path.push(n.ident.to_string());
            out.push((n.ident.to_string(), path));
        }
        syn::UseTree::Rename(r) => {
            let mut path = prefix.clone();
            path.push(r.ident.to_string());
            out.push((r.rename.to_string(), path));
        }
        syn::UseTree::Group(g) => g.items.iter().for_each(|t| use_paths(t, prefix, out)),
        syn::UseTree::Glob(_) => panic!("a glob re-export: list its names instead"),
    }
}

/// The name of the type an impl is for (its last path segment).
fn self_name(ty: &syn::Type) -> Option<String> {
    match ty {
        syn::Type::Path(p) => p.path.segments.last().map(|s| s.ident.to_string()),
        _ => None,
    }
}

/// The traits `attrs` derive, as a member line (`: derive Clone, Debug`), if any: a derive is a
/// promise (a dependent clones, compares, prints).
fn derives(attrs: &[syn::Attribute]) -> Option<String> {
    let mut traits = Vec::new();
    for a in attrs.iter().filter(|a| a.path().is_ident("derive")) {
        let _ = a.parse_nested_meta(|m| {
            traits.push(tokens(&m.path));
            Ok(())
        });
    }
    (!traits.is_empty()).then(|| format!(": derive {}", traits.join(", ")))
}

/// `text` split at its top-level commas (not those inside `<>`, `()` or `[]`).
fn top_level(text: &str) -> Vec<&str> {
    let (mut parts, mut depth, mut start) = (Vec::new(), 0i32, 0);
    for (i, c) in text.char_indices() {
        match c {
            '<' | '(' | '[' => depth += 1,
            // `->` closes nothing.
            '>' if text[..i].ends_with('-') => {}
            '>' | ')' | ']' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&text[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&text[start..]);
    parts
}

fn struct_def(s: &syn::ItemStruct) -> Def {
    let members = (s.fields.iter().enumerate())
        .filter(|(_, f)| is_pub(&f.vis))
        .map(|(i, f)| match &f.ident {
            Some(name) => format!(".{name}: {}", tokens(&f.ty)),
            None => format!(".{i}: {}", tokens(&f.ty)),
        })
        .chain(derives(&s.attrs))
        .collect();
    let private = s.fields.iter().any(|f| !is_pub(&f.vis));
    Def {
        head: format!(
            "{}struct{}{}",
            non_exhaustive(&s.attrs),
            tokens(&s.generics),
            match (&s.fields, private) {
                (syn::Fields::Unit, _) => "",
                (_, true) => " (private fields)",
                (_, false) => "",
            }
        ),
        members,
        is_type: true,
    }
}

fn enum_def(e: &syn::ItemEnum) -> Def {
    let members = e
        .variants
        .iter()
        .map(|v| {
            // Types only: the fields' docs and attributes are no part of the promise.
            let types = |f: &syn::Fields| -> Vec<String> {
                (f.iter())
                    .map(|f| match &f.ident {
                        Some(name) => format!("{name}: {}", tokens(&f.ty)),
                        None => tokens(&f.ty),
                    })
                    .collect()
            };
            let fields = match &v.fields {
                syn::Fields::Unit => String::new(),
                f @ syn::Fields::Named(_) => format!(" {{ {} }}", types(f).join(", ")),
                f @ syn::Fields::Unnamed(_) => format!("({})", types(f).join(", ")),
            };
            format!("::{}{}{fields}", non_exhaustive(&v.attrs), v.ident)
        })
        .chain(derives(&e.attrs))
        .collect();
    Def {
        head: format!("{}enum{}", non_exhaustive(&e.attrs), tokens(&e.generics)),
        members,
        is_type: true,
    }
}

fn trait_def(t: &syn::ItemTrait) -> Def {
    let members = t
        .items
        .iter()
        .filter_map(|i| match i {
            syn::TraitItem::Fn(f) => Some(format!(": {}", tokens(&f.sig))),
            syn::TraitItem::Type(ty) => Some(format!(": type {}", ty.ident)),
            syn::TraitItem::Const(c) => Some(format!(": const {}: {}", c.ident, tokens(&c.ty))),
            _ => None,
        })
        .collect();
    let bounds = match t.supertraits.is_empty() {
        true => String::new(),
        false => format!(": {}", tokens(&t.supertraits)),
    };
    Def {
        head: format!("trait{}{bounds}", tokens(&t.generics)),
        members,
        is_type: true,
    }
}

/// The public definition of `item`, with its name, if it is `pub`.
fn def_of(item: &syn::Item) -> Option<(String, Def)> {
    let simple = |head: String| Def {
        head,
        ..Def::default()
    };
    Some(match item {
        syn::Item::Struct(s) if is_pub(&s.vis) => (s.ident.to_string(), struct_def(s)),
        syn::Item::Enum(e) if is_pub(&e.vis) => (e.ident.to_string(), enum_def(e)),
        syn::Item::Trait(t) if is_pub(&t.vis) => (t.ident.to_string(), trait_def(t)),
        syn::Item::Fn(f) if is_pub(&f.vis) => (f.sig.ident.to_string(), simple(tokens(&f.sig))),
        syn::Item::Const(c) if is_pub(&c.vis) => (
            c.ident.to_string(),
            simple(format!("const: {}", tokens(&c.ty))),
        ),
        syn::Item::Static(s) if is_pub(&s.vis) => (
            s.ident.to_string(),
            simple(format!("static: {}", tokens(&s.ty))),
        ),
        syn::Item::Type(t) if is_pub(&t.vis) => (
            t.ident.to_string(),
            Def {
                head: format!("type{} = {}", tokens(&t.generics), tokens(&t.ty)),
                is_type: true,
                ..Def::default()
            },
        ),
        _ => return None,
    })
}

impl Crate {
    /// Reads `items` as the module `path` (in `dir`, for its out-of-line children).
    fn read(&mut self, path: &[String], items: &[syn::Item], dir: &Path) {
        let key = path.join("::");
        for item in items {
            let cfg = match item {
                syn::Item::Mod(m) => cfg_of(&m.attrs),
                syn::Item::Use(u) => cfg_of(&u.attrs),
                syn::Item::Impl(i) => cfg_of(&i.attrs),
                syn::Item::Fn(f) => cfg_of(&f.attrs),
                syn::Item::Struct(s) => cfg_of(&s.attrs),
                syn::Item::Enum(e) => cfg_of(&e.attrs),
                _ => None,
            };
            if cfg.as_deref() == Some("test") {
                continue;
            }
            match item {
                syn::Item::Mod(m) => self.read_child(path, m, dir, cfg),
                syn::Item::Use(u) if is_pub(&u.vis) => {
                    let mut out = Vec::new();
                    use_paths(&u.tree, &mut Vec::new(), &mut out);
                    let module = self.modules.entry(key.clone()).or_default();
                    for (name, target) in out {
                        module.reexports.insert(name, (target, cfg.clone()));
                    }
                }
                syn::Item::Impl(i) => self.read_impl(i, cfg),
                syn::Item::Macro(m) if m.mac.path.is_ident("setters") => {
                    // `setters!(Type { kind field: Type, ... })`: a setter per field.
                    let body = tokens(&m.mac.tokens);
                    let (ty, fields) = body.split_once('{').unwrap();
                    let fields = fields.trim_end_matches('}').trim().trim_end_matches(',');
                    let entry = self.impls.entry(ty.trim().to_string()).or_default();
                    for f in top_level(fields) {
                        entry.insert(format!(": setter {}", f.trim()));
                    }
                }
                item => {
                    if let Some((name, def)) = def_of(item) {
                        let module = self.modules.entry(key.clone()).or_default();
                        module.items.insert(name, (def, cfg));
                    }
                }
            }
        }
    }

    fn read_child(&mut self, path: &[String], m: &syn::ItemMod, dir: &Path, cfg: Option<String>) {
        let name = m.ident.to_string();
        let mut child = path.to_vec();
        child.push(name.clone());
        if is_pub(&m.vis) {
            let module = self.modules.entry(path.join("::")).or_default();
            module.public_children.insert(name.clone(), cfg);
        }
        self.modules.entry(child.join("::")).or_default();
        match &m.content {
            Some((_, items)) => self.read(&child, items, &dir.join(&name)),
            None => {
                let (file, sub) = match dir.join(format!("{name}.rs")) {
                    f if f.exists() => (f, dir.join(&name)),
                    _ => (dir.join(&name).join("mod.rs"), dir.join(&name)),
                };
                let source = std::fs::read_to_string(&file)
                    .unwrap_or_else(|e| panic!("{}: {e}", file.display()));
                let parsed = syn::parse_file(&source).unwrap();
                self.read(&child, &parsed.items, &sub);
            }
        }
    }

    fn read_impl(&mut self, i: &syn::ItemImpl, cfg: Option<String>) {
        let Some(ty) = self_name(&i.self_ty) else {
            return;
        };
        let behind = cfg.map_or(String::new(), |c| format!(" [cfg({c})]"));
        let entry = self.impls.entry(ty).or_default();
        match &i.trait_ {
            Some((not, path, _)) => {
                let not = if not.is_some() { "!" } else { "" };
                entry.insert(format!(": impl {not}{}{behind}", tokens(path)));
            }
            None => {
                for item in &i.items {
                    if let syn::ImplItem::Fn(f) = item {
                        let own = made_pub(&f.attrs).or_else(|| cfg_of(&f.attrs));
                        let made = made_pub(&f.attrs).is_some();
                        if (is_pub(&f.vis) || made) && own.as_deref() != Some("test") {
                            let behind = match own {
                                Some(c) => format!(" [cfg({c})]"),
                                None => behind.clone(),
                            };
                            entry.insert(format!("::{}{behind}", tokens(&f.sig)));
                        }
                    }
                }
            }
        }
    }

    /// `path` as written in module `at`, made absolute (`crate::...`); `None` for a path into
    /// another crate.
    fn absolute(&self, at: &[String], path: &[String]) -> Option<Vec<String>> {
        let (first, rest) = path.split_first()?;
        let mut base = match first.as_str() {
            "crate" => vec!["crate".to_string()],
            "self" => at.to_vec(),
            "super" => at[..at.len().checked_sub(1)?].to_vec(),
            child => {
                let mut p = at.to_vec();
                p.push(child.to_string());
                if !self.modules.contains_key(&p.join("::")) {
                    return None;
                }
                p
            }
        };
        base.extend(rest.iter().cloned());
        Some(base)
    }

    /// The definition `target` names as written in module `at` (following re-exports), if it
    /// is in this crate.
    fn resolve(&self, at: &[String], target: &[String]) -> Option<(Def, String)> {
        let target = self.absolute(at, target)?;
        let (name, module) = target.split_last()?;
        let m = self.modules.get(&module.join("::"))?;
        if let Some((def, _)) = m.items.get(name) {
            return Some((def.clone(), name.clone()));
        }
        let (next, _) = m.reexports.get(name)?;
        self.resolve(module, next)
    }

    /// Every line of the public API, sorted.
    fn list(&self) -> Vec<String> {
        let mut lines = BTreeSet::new();
        let root = ["crate".to_string()];
        self.list_module(&root, &["pensieve".to_string()], None, &mut lines);
        lines.into_iter().collect()
    }

    /// Lists module `path` as a dependent names it, `public`.
    fn list_module(
        &self,
        path: &[String],
        public_path: &[String],
        cfg: Option<&str>,
        lines: &mut BTreeSet<String>,
    ) {
        let Some(m) = self.modules.get(&path.join("::")) else {
            return;
        };
        let public = |name: &str| {
            let mut p = public_path.to_vec();
            p.push(name.to_string());
            p.join("::")
        };
        let tag = |own: Option<&String>| match own.map(String::as_str).or(cfg) {
            Some(c) => format!(" [cfg({c})]"),
            None => String::new(),
        };
        for (name, (def, own)) in &m.items {
            self.list_def(&public(name), name, def, &tag(own.as_ref()), lines);
        }
        for (name, (target, own)) in &m.reexports {
            let at = public(name);
            let tagged = tag(own.as_ref());
            let module =
                (self.absolute(path, target)).filter(|t| self.modules.contains_key(&t.join("::")));
            if let Some(module) = module {
                let mut p = public_path.to_vec();
                p.push(name.clone());
                lines.insert(format!("{at}: mod{tagged}"));
                self.list_module(&module, &p, own.as_deref().or(cfg), lines);
                continue;
            }
            match self.resolve(path, target) {
                Some((def, original)) => self.list_def(&at, &original, &def, &tagged, lines),
                None => {
                    let target = target.join("::");
                    lines.insert(format!("{at}: pub use {target}{tagged}"));
                }
            }
        }
        for (child, own) in &m.public_children {
            let mut p = path.to_vec();
            p.push(child.clone());
            let mut public_child = public_path.to_vec();
            public_child.push(child.clone());
            let inherited = own.as_deref().or(cfg);
            lines.insert(format!("{}: mod{}", public(child), tag(own.as_ref())));
            self.list_module(&p, &public_child, inherited, lines);
        }
    }

    fn list_def(&self, at: &str, name: &str, def: &Def, tag: &str, lines: &mut BTreeSet<String>) {
        lines.insert(format!("{at}: {}{tag}", def.head));
        for member in &def.members {
            lines.insert(format!("{at}{member}"));
        }
        if def.is_type {
            for line in self.impls.get(name).into_iter().flatten() {
                lines.insert(format!("{at}{line}"));
            }
        }
    }
}

#[test]
fn the_public_api_is_the_committed_list() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let lib = std::fs::read_to_string(root.join("src/lib.rs")).unwrap();
    let mut krate = Crate::default();
    krate.read(
        &["crate".to_string()],
        &syn::parse_file(&lib).unwrap().items,
        &root.join("src"),
    );
    let listed = krate.list().join("\n") + "\n";
    let file = root.join("docs/public-api.txt");
    if std::env::var_os("PENSIEVE_BLESS_API").is_some() {
        std::fs::write(&file, &listed).unwrap();
    }
    let committed = std::fs::read_to_string(&file).unwrap_or_default();
    let old: BTreeSet<&str> = committed.lines().collect();
    let new: BTreeSet<&str> = listed.lines().collect();
    let gone: Vec<&&str> = old.difference(&new).collect();
    let added: Vec<&&str> = new.difference(&old).collect();
    assert!(
        gone.is_empty() && added.is_empty(),
        "the public API changed: if that is meant, rerun with PENSIEVE_BLESS_API=1 and \
         commit docs/public-api.txt.\nremoved: {gone:#?}\nadded: {added:#?}"
    );
}

#[test]
fn setters_split_only_at_their_outer_commas() {
    assert_eq!(
        top_level("value a: Vec<(u32, f32)>, some b: Map<String, Value>, c: fn(u8) -> u8"),
        [
            "value a: Vec<(u32, f32)>",
            " some b: Map<String, Value>",
            " c: fn(u8) -> u8"
        ]
    );
}

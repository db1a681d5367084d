//! The service uses nothing of the crate a dependent could not name, so that any host can do
//! what it does; the server the same over the service. Checked on the crate's code (`syn`):
//! the names a host's files use, against the names the rest of the crate declares short of
//! `pub`.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;

use syn::visit::Visit;

#[path = "common/sources.rs"]
mod sources;

use sources::{crate_sources, module_path};

/// Names declared `pub`, and names declared short of it (`pub(crate)`, `pub(super)`,
/// `pub(in ...)`) where the whole crate sees them: items anywhere, and methods (only the
/// engine's, whose methods the service calls; elsewhere a method name says too little of its
/// type). What a narrower visibility hides from the service the compiler already keeps out.
#[derive(Default)]
struct Declared {
    restricted: BTreeSet<String>,
    public: BTreeSet<String>,
    /// The module of the code being read.
    module: Vec<String>,
    /// Whether it is the engine's.
    engine: bool,
}

impl Declared {
    fn read(&mut self, path: &str, file: &syn::File) {
        self.module = module_path(path);
        self.engine = self.module.get(1).is_some_and(|m| m == "engine");
        self.visit_file(file);
    }

    fn note(&mut self, vis: &syn::Visibility, name: &syn::Ident) {
        let scope = |r: &syn::VisRestricted| -> Vec<String> {
            let path: Vec<String> = (r.path.segments.iter())
                .map(|s| s.ident.to_string())
                .collect();
            match path.first().map(String::as_str) {
                Some("super") => self.module[..self.module.len().saturating_sub(1)].to_vec(),
                Some("self") => self.module.clone(),
                _ => path,
            }
        };
        match vis {
            syn::Visibility::Public(_) => drop(self.public.insert(name.to_string())),
            syn::Visibility::Restricted(r) if scope(r) == ["crate"] => {
                self.restricted.insert(name.to_string());
            }
            _ => {}
        }
    }
}

impl<'ast> Visit<'ast> for Declared {
    fn visit_item(&mut self, item: &'ast syn::Item) {
        match item {
            syn::Item::Fn(f) => self.note(&f.vis, &f.sig.ident),
            syn::Item::Struct(s) => self.note(&s.vis, &s.ident),
            syn::Item::Enum(e) => self.note(&e.vis, &e.ident),
            syn::Item::Type(t) => self.note(&t.vis, &t.ident),
            syn::Item::Trait(t) => self.note(&t.vis, &t.ident),
            syn::Item::Const(c) => self.note(&c.vis, &c.ident),
            _ => {}
        }
        if let syn::Item::Mod(m) = item {
            self.module.push(m.ident.to_string());
            syn::visit::visit_item(self, item);
            self.module.pop();
        } else {
            syn::visit::visit_item(self, item);
        }
    }

    fn visit_impl_item_fn(&mut self, f: &'ast syn::ImplItemFn) {
        if self.engine {
            self.note(&f.vis, &f.sig.ident);
        }
        syn::visit::visit_impl_item_fn(self, f);
    }
}

/// The names of the items and methods the service declares itself, whatever their visibility.
#[derive(Default)]
struct Names(BTreeSet<String>);

impl<'ast> Visit<'ast> for Names {
    fn visit_item(&mut self, item: &'ast syn::Item) {
        let name = match item {
            syn::Item::Fn(f) => Some(&f.sig.ident),
            syn::Item::Struct(s) => Some(&s.ident),
            syn::Item::Enum(e) => Some(&e.ident),
            syn::Item::Type(t) => Some(&t.ident),
            syn::Item::Trait(t) => Some(&t.ident),
            syn::Item::Const(c) => Some(&c.ident),
            _ => None,
        };
        self.0.extend(name.map(ToString::to_string));
        syn::visit::visit_item(self, item);
    }

    fn visit_impl_item_fn(&mut self, f: &'ast syn::ImplItemFn) {
        self.0.insert(f.sig.ident.to_string());
        syn::visit::visit_impl_item_fn(self, f);
    }
}

/// What the service names of the rest of the crate: what it imports from `crate::` or
/// `super::` (at the service's root, the crate's), the items of paths that start there, and
/// the methods it calls.
#[derive(Default)]
struct Used(BTreeSet<String>);

impl Used {
    fn use_tree(&mut self, tree: &syn::UseTree) {
        match tree {
            syn::UseTree::Path(p) => self.use_tree(&p.tree),
            syn::UseTree::Name(n) => drop(self.0.insert(n.ident.to_string())),
            syn::UseTree::Rename(r) => drop(self.0.insert(r.ident.to_string())),
            syn::UseTree::Group(g) => g.items.iter().for_each(|t| self.use_tree(t)),
            syn::UseTree::Glob(_) => {}
        }
    }
}

impl<'ast> Visit<'ast> for Used {
    fn visit_expr_method_call(&mut self, m: &'ast syn::ExprMethodCall) {
        self.0.insert(m.method.to_string());
        syn::visit::visit_expr_method_call(self, m);
    }

    fn visit_path(&mut self, p: &'ast syn::Path) {
        if p.segments.first().is_some_and(|s| s.ident == "crate") {
            self.0
                .extend(p.segments.iter().skip(1).map(|s| s.ident.to_string()));
        }
        syn::visit::visit_path(self, p);
    }

    fn visit_item_use(&mut self, u: &'ast syn::ItemUse) {
        if let syn::UseTree::Path(p) = &u.tree
            && (p.ident == "crate" || p.ident == "super")
        {
            self.use_tree(&p.tree);
        }
    }
}

/// The crate-only names (declared short of `pub`, and not also `pub` elsewhere) declared
/// outside the host module `host` (`service`, `server`) that files under it use.
fn back_channels(files: &[(String, String)], host: &str) -> Vec<String> {
    let (mut declared, mut own, mut used) =
        (Declared::default(), Names::default(), Used::default());
    for (path, source) in files {
        let file = syn::parse_file(source).unwrap_or_else(|e| panic!("{path}: {e}"));
        if path.starts_with(&format!("{host}/")) || *path == format!("{host}.rs") {
            used.visit_file(&file);
            own.visit_file(&file);
        } else {
            declared.read(path, &file);
        }
    }
    let crate_only = &(&declared.restricted - &declared.public) - &own.0;
    crate_only.intersection(&used.0).cloned().collect()
}

/// The service is a host of the engine like any other: it keeps store reads off the step
/// thread with the engine's public `ResumeReader`, and reaches nothing of the crate that a
/// dependent could not (no `pub(crate)` back channel between the two). The same holds for the
/// server over the service: a downstream crate could write it.
#[test]
fn the_service_and_the_server_use_only_what_a_dependent_can_name() {
    let files = crate_sources();
    for host in ["service", "server"] {
        assert!(files
            .iter()
            .any(|(p, _)| p.starts_with(&format!("{host}/"))));
        let found = back_channels(&files, host);
        assert!(
            found.is_empty(),
            "the {host} uses crate-only items: {found:?}"
        );
    }
}

#[test]
fn a_crate_only_method_or_type_the_service_uses_is_found() {
    let engine = "pub struct Engine; impl Engine { pub fn open(&self) {} \
                  pub(crate) fn open_with(&self) {} } pub(crate) struct Fetched; \
                  pub(super) fn helper() {}";
    let files = |service: &str| {
        vec![
            ("engine/mod.rs".to_string(), engine.to_string()),
            ("service/mod.rs".to_string(), service.to_string()),
        ]
    };
    assert!(back_channels(
        &files("fn f(e: &crate::engine::Engine) { e.open(); }"),
        "service"
    )
    .is_empty());
    assert_eq!(
        back_channels(
            &files("fn f(e: &crate::engine::Engine) { e.open_with(); }"),
            "service"
        ),
        ["open_with"]
    );
    assert_eq!(
        back_channels(&files("use crate::engine::{Engine, Fetched};"), "service"),
        ["Fetched"]
    );
    assert_eq!(
        back_channels(&files("fn f() { crate::engine::helper() }"), "service"),
        ["helper"]
    );
}

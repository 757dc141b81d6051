//! Reelay is Apache-2.0: every crate it builds with must be usable under a permissive licence.
//! Reads the licence of every package in the lock file (`cargo metadata`) and fails on any that
//! does not offer one, naming the crate, so a copyleft dependency is caught when it is added.

use std::process::Command;

/// Licences a dependency of an Apache-2.0 project may be used under (SPDX identifiers).
const PERMISSIVE: &[&str] = &[
    "0BSD",
    "Apache-2.0",
    "Apache-2.0 WITH LLVM-exception",
    "BSD-2-Clause",
    "BSD-3-Clause",
    "BSL-1.0",
    "CC0-1.0",
    "CDLA-Permissive-2.0",
    "ISC",
    "MIT",
    "MIT-0",
    "Unicode-3.0",
    "Unicode-DFS-2016",
    "Unlicense",
    "Zlib",
    "zlib-acknowledgement",
];

/// Whether an SPDX licence expression can be met with permissive licences only: `OR` (and the
/// older `/`) needs one side, `AND` needs both. Parentheses group; `WITH` stays part of the
/// licence it qualifies. An expression that does not parse is not permissive.
fn permissive(expression: &str) -> bool {
    let spaced = expression.replace('(', " ( ").replace(')', " ) ").replace('/', " OR ");
    let tokens: Vec<&str> = spaced.split_whitespace().collect();
    let mut at = 0;
    any_of(&tokens, &mut at).is_some_and(|allowed| allowed && at == tokens.len())
}

/// `term (OR term)*`; `None` when malformed.
fn any_of(tokens: &[&str], at: &mut usize) -> Option<bool> {
    let mut allowed = all_of(tokens, at)?;
    while tokens.get(*at) == Some(&"OR") {
        *at += 1;
        allowed |= all_of(tokens, at)?;
    }
    Some(allowed)
}

/// `licence (AND licence)*`
fn all_of(tokens: &[&str], at: &mut usize) -> Option<bool> {
    let mut allowed = licence(tokens, at)?;
    while tokens.get(*at) == Some(&"AND") {
        *at += 1;
        allowed &= licence(tokens, at)?;
    }
    Some(allowed)
}

/// One licence (`ID`, `ID WITH EXCEPTION`) or a parenthesised expression.
fn licence(tokens: &[&str], at: &mut usize) -> Option<bool> {
    let token = *tokens.get(*at)?;
    *at += 1;
    match token {
        "(" => {
            let allowed = any_of(tokens, at)?;
            (tokens.get(*at) == Some(&")")).then(|| *at += 1)?;
            Some(allowed)
        }
        ")" | "OR" | "AND" | "WITH" => None,
        id if tokens.get(*at) == Some(&"WITH") => {
            let exception = tokens.get(*at + 1)?;
            *at += 2;
            Some(PERMISSIVE.contains(&format!("{id} WITH {exception}").as_str()))
        }
        id => Some(PERMISSIVE.contains(&id)),
    }
}

#[test]
fn licence_expressions_are_read_as_spdx_says() {
    for ok in [
        "MIT",
        "MIT OR Apache-2.0",
        "MIT/Apache-2.0",
        "(MIT OR Apache-2.0) AND Unicode-3.0",
        "Apache-2.0 WITH LLVM-exception",
    ] {
        assert!(permissive(ok), "{ok} is permissive");
    }
    for not in [
        "GPL-3.0-only",
        "AGPL-3.0-or-later",
        "MIT AND GPL-2.0-only",
        "(MIT OR Apache-2.0) AND LGPL-2.1-or-later",
        "GPL-2.0-only WITH Classpath-exception-2.0",
        "MIT OR",
        "(MIT",
        "",
    ] {
        assert!(!permissive(not), "{not:?} is not permissive");
    }
    // A permissive choice is enough when the expression offers one.
    assert!(permissive("MIT OR Apache-2.0 OR LGPL-2.1-or-later"));
}

#[test]
fn every_dependency_is_usable_under_a_permissive_licence() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let output = Command::new(cargo)
        .args(["metadata", "--format-version", "1", "--locked"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo metadata runs");
    assert!(output.status.success(), "cargo metadata failed: {}", String::from_utf8_lossy(&output.stderr));
    let metadata: serde_json::Value = serde_json::from_slice(&output.stdout).expect("cargo metadata prints JSON");
    let packages = metadata["packages"].as_array().expect("packages");
    // The whole build graph, not only what this machine compiles: dependencies of every target
    // and platform are in the lock file and would ship with someone's build.
    assert!(packages.len() > 100, "cargo metadata listed only {} packages", packages.len());
    let refused: Vec<String> = packages
        .iter()
        .filter_map(|package| {
            let name = package["name"].as_str().unwrap_or("?");
            let version = package["version"].as_str().unwrap_or("?");
            match package["license"].as_str() {
                Some(expression) if permissive(expression) => None,
                Some(expression) => Some(format!("{name} {version}: {expression}")),
                None => Some(format!("{name} {version}: no SPDX licence in its manifest")),
            }
        })
        .collect();
    assert!(refused.is_empty(), "dependencies without a permissive licence:\n{}", refused.join("\n"));
}

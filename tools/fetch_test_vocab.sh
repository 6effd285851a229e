#!/usr/bin/env bash
# The o200k_base vocabulary that openai-harmony (the gpt-oss oracle of tests/test_tool_calls_harmony.py)
# reads, which it would otherwise download at run time: the tiktoken-rs crate on crates.io ships it, and
# `cargo fetch` unpacks it into cargo's registry, where the test finds it. Safe to repeat (cached).
set -euo pipefail
if compgen -G "${CARGO_HOME:-$HOME/.cargo}/registry/src/*/tiktoken-rs-*/assets/o200k_base.tiktoken" > /dev/null; then
    exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir "$tmp/src" && touch "$tmp/src/lib.rs"
printf '[package]\nname = "vocab"\nversion = "0.0.0"\nedition = "2021"\n\n[dependencies]\ntiktoken-rs = "=0.7.0"\n' > "$tmp/Cargo.toml"
(cd "$tmp" && cargo fetch -q)
compgen -G "${CARGO_HOME:-$HOME/.cargo}/registry/src/*/tiktoken-rs-*/assets/o200k_base.tiktoken" > /dev/null

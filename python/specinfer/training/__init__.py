"""Draft-head training on CPU (`specinfer train-heads`), its distillation data, and the named-head
recipes (heads trained once on first use, then cached). Training drives the engine through
Generator; nothing in the runtime (engine/, spec_decode/, executor/) imports this package: a named
head is resolved to its checkpoint directory by Generator (or the CLI) before the engine is built."""

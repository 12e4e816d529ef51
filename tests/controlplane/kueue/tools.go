//go:build tools

// Package tools pins Kueue's controller manager, which tests/controlplane/build.py builds from
// this module (go build sigs.k8s.io/kueue/cmd/kueue) for tests/controlplane/test_real_kueue.py.
// Nothing of ours is compiled: this file only keeps the requirement in go.mod.
package tools

import _ "sigs.k8s.io/kueue/cmd/kueue"

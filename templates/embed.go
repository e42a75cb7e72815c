// Package templates holds the text/template sources the generator renders. They are embedded
// here because //go:embed cannot reach a parent directory from gen/.
package templates

import "embed"

// FS holds cuda/*.tmpl (out/) and vocab/*.tmpl (the checked-in vocabulary files); paths inside it
// are relative to templates/.
//
//go:embed cuda/*.tmpl vocab/*.tmpl
var FS embed.FS

// Package templates holds the text/template sources the generator renders. They are embedded
// here because //go:embed cannot reach a parent directory from gen/.
package templates

import "embed"

// FS holds cuda/*.tmpl; paths inside it are relative to templates/.
//
//go:embed cuda/*.tmpl
var FS embed.FS

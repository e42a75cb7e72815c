package main

// A small strict walker over yaml.Node. yaml.v3's Decode into structs cannot reject unknown keys
// with a position, nor say which list element is wrong, so the model is read node by node: every
// error carries the file, the line, the field path (groups[0].dtypes[1]), the offending value and
// the rule it breaks, and is printed as one line.

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"

	"gopkg.in/yaml.v3"
)

// InputError is a problem with a user-supplied file or flag. It prints as
// "file:line: path: value: rule", leaving out the parts it does not have.
type InputError struct {
	File  string
	Line  int
	Path  string
	Value string // already formatted: strings quoted, numbers bare
	Rule  string
}

func (e *InputError) Error() string {
	var b strings.Builder
	b.WriteString(e.File)
	if e.Line > 0 {
		fmt.Fprintf(&b, ":%d", e.Line)
	}
	b.WriteString(": ")
	if e.Path != "" {
		b.WriteString(e.Path)
		b.WriteString(": ")
	}
	if e.Value != "" {
		b.WriteString(e.Value)
		b.WriteString(": ")
	}
	b.WriteString(e.Rule)
	return b.String()
}

// doc is one YAML file being walked.
type doc struct {
	file string
}

// errAt builds an InputError located at n.
func (d *doc) errAt(n *yaml.Node, path string, rule string, args ...any) *InputError {
	e := &InputError{File: d.file, Path: path, Rule: fmt.Sprintf(rule, args...)}
	if n != nil {
		e.Line = n.Line
		if n.Kind == yaml.ScalarNode {
			e.Value = scalarText(n)
		}
	}
	return e
}

// errNoValue is errAt without the node's value in the message.
func (d *doc) errNoValue(n *yaml.Node, path string, rule string, args ...any) *InputError {
	e := d.errAt(n, path, rule, args...)
	e.Value = ""
	return e
}

// scalarText formats a scalar for an error message: strings quoted, everything else as written.
func scalarText(n *yaml.Node) string {
	if n.Tag == "!!str" {
		return strconv.Quote(n.Value)
	}
	return n.Value
}

var yamlLineRE = regexp.MustCompile(`^yaml: line (\d+): (.*)$`)

// load reads and parses path into the root node of its single document. A file with no content
// gives a nil root and no error.
func load(path string) (*doc, *yaml.Node, error) {
	d := &doc{file: path}
	data, err := os.ReadFile(path)
	if err != nil {
		var pe *os.PathError
		if errors.As(err, &pe) {
			err = pe.Err
		}
		return d, nil, &InputError{File: path, Rule: "cannot read: " + err.Error()}
	}
	dec := yaml.NewDecoder(bytes.NewReader(data))
	var root yaml.Node
	if err := dec.Decode(&root); err != nil {
		if errors.Is(err, io.EOF) {
			return d, nil, nil
		}
		return d, nil, d.malformed(err)
	}
	var extra yaml.Node
	if err := dec.Decode(&extra); err == nil {
		return d, nil, &InputError{File: path, Line: extra.Line, Rule: "malformed YAML: more than one document"}
	} else if !errors.Is(err, io.EOF) {
		return d, nil, d.malformed(err)
	}
	if root.Kind != yaml.DocumentNode || len(root.Content) != 1 {
		return d, nil, nil
	}
	return d, root.Content[0], nil
}

func (d *doc) malformed(err error) *InputError {
	msg := strings.TrimSpace(strings.SplitN(err.Error(), "\n", 2)[0])
	if m := yamlLineRE.FindStringSubmatch(msg); m != nil {
		line, _ := strconv.Atoi(m[1])
		return &InputError{File: d.file, Line: line, Rule: "malformed YAML: " + m[2]}
	}
	return &InputError{File: d.file, Rule: "malformed YAML: " + strings.TrimPrefix(msg, "yaml: ")}
}

func resolve(n *yaml.Node) *yaml.Node {
	for n != nil && n.Kind == yaml.AliasNode {
		n = n.Alias
	}
	return n
}

func kindName(n *yaml.Node) string {
	switch n.Kind {
	case yaml.MappingNode:
		return "a mapping"
	case yaml.SequenceNode:
		return "a list"
	case yaml.ScalarNode:
		switch n.Tag {
		case "!!null":
			return "null"
		case "!!str":
			return "a string"
		case "!!int":
			return "an integer"
		case "!!float":
			return "a number"
		case "!!bool":
			return "a boolean"
		}
		return "a scalar"
	}
	return "nothing"
}

func join(path, key string) string {
	if path == "" {
		return key
	}
	return path + "." + key
}

func index(path string, i int) string { return fmt.Sprintf("%s[%d]", path, i) }

// fields checks that n is a mapping whose keys are all in allowed, none twice, and every one in
// required present. It returns the value node of each key that is present.
func (d *doc) fields(n *yaml.Node, path string, allowed, required []string) (map[string]*yaml.Node, error) {
	n = resolve(n)
	if n.Kind != yaml.MappingNode {
		where := path
		if where == "" {
			where = "top level"
		}
		return nil, d.errAt(n, path, "want a mapping at the %s, got %s", where, kindName(n))
	}
	got := map[string]*yaml.Node{}
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, v := resolve(n.Content[i]), n.Content[i+1]
		if k.Kind != yaml.ScalarNode {
			return nil, d.errNoValue(k, path, "want a plain key, got %s", kindName(k))
		}
		if !slices.Contains(allowed, k.Value) {
			return nil, d.errNoValue(k, join(path, k.Value), "unknown key (want one of %s)", strings.Join(allowed, ", "))
		}
		if _, dup := got[k.Value]; dup {
			return nil, d.errNoValue(k, join(path, k.Value), "key given twice")
		}
		got[k.Value] = v
	}
	for _, r := range required {
		if _, ok := got[r]; !ok {
			return nil, d.errNoValue(n, join(path, r), "required key missing")
		}
	}
	return got, nil
}

// seq checks that n is a list and returns its items.
func (d *doc) seq(n *yaml.Node, path string) ([]*yaml.Node, error) {
	n = resolve(n)
	if n.Kind != yaml.SequenceNode {
		return nil, d.errAt(n, path, "want a list, got %s", kindName(n))
	}
	return n.Content, nil
}

func (d *doc) str(n *yaml.Node, path string) (string, error) {
	n = resolve(n)
	if n.Kind != yaml.ScalarNode || n.Tag != "!!str" {
		return "", d.errAt(n, path, "want a string, got %s", kindName(n))
	}
	return n.Value, nil
}

func (d *doc) integer(n *yaml.Node, path string) (int, error) {
	n = resolve(n)
	if n.Kind != yaml.ScalarNode || n.Tag != "!!int" {
		return 0, d.errAt(n, path, "want an integer, got %s", kindName(n))
	}
	var v int64
	if err := n.Decode(&v); err != nil || v < -1<<31 || v > 1<<31-1 {
		return 0, d.errAt(n, path, "integer out of range")
	}
	return int(v), nil
}

func (d *doc) boolean(n *yaml.Node, path string) (bool, error) {
	n = resolve(n)
	if n.Kind != yaml.ScalarNode || n.Tag != "!!bool" {
		return false, d.errAt(n, path, "want true or false, got %s", kindName(n))
	}
	var v bool
	if err := n.Decode(&v); err != nil {
		return false, d.errAt(n, path, "want true or false")
	}
	return v, nil
}

// strList reads a list of strings, rejecting an entry given twice.
func (d *doc) strList(n *yaml.Node, path string) ([]string, []*yaml.Node, error) {
	items, err := d.seq(n, path)
	if err != nil {
		return nil, nil, err
	}
	var out []string
	for i, it := range items {
		s, err := d.str(it, index(path, i))
		if err != nil {
			return nil, nil, err
		}
		if slices.Contains(out, s) {
			return nil, nil, d.errAt(resolve(it), index(path, i), "listed twice")
		}
		out = append(out, s)
	}
	return out, items, nil
}

// intList reads a list of integers, rejecting an entry given twice.
func (d *doc) intList(n *yaml.Node, path string) ([]int, []*yaml.Node, error) {
	items, err := d.seq(n, path)
	if err != nil {
		return nil, nil, err
	}
	var out []int
	for i, it := range items {
		v, err := d.integer(it, index(path, i))
		if err != nil {
			return nil, nil, err
		}
		for _, x := range out {
			if x == v {
				return nil, nil, d.errAt(resolve(it), index(path, i), "listed twice")
			}
		}
		out = append(out, v)
	}
	return out, items, nil
}

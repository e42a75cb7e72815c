// Command gen generates the arfuse kernel instances, their dispatch table and the torch op
// registration from a variant matrix.
//
//	make gen    # builds build/bin/gen (go build -o build/bin/gen ./gen)
//	build/bin/gen [--matrix FILE|NAME] [--out DIR] [--root DIR] [--only GLOB]... [--list] [--check]
//	              [--tuning FILE] [--models FILE]
//
// It runs in four steps: model (model.go: strict YAML → matrix, models, tuning, each value with
// where it was written), plan (plan.go: every feasibility rule, one kernel shape per variant),
// render (render.go + templates/cuda: files in memory) and write (write.go: only changed files,
// stale generated files removed). Every run also renders the vocabulary of tables.go into its two
// checked-in files under --root (vocab.go: csrc/arfuse/vocab.h, arfuse/_vocab_tables.py), which
// --check compares as it compares --out.
//
// Exit status: 0 success, 1 --check found differences, 2 bad input (one line on stderr naming
// file, field, value and the rule broken) or an I/O error. These are the binary's; `go run ./gen`
// reports every non-zero status as 1 and adds its own "exit status N" line.
package main

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"

	"github.com/spf13/pflag"
)

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

const usageHead = `Usage: build/bin/gen [flags]    (make gen builds it)

Generates the arfuse kernel instances (one .cu per variant), the dispatch table, the torch op
registration, manifest.json and sources.mk from a variant matrix into --out, and the vocabulary
of gen/tables.go into its checked-in files under --root (csrc/arfuse/vocab.h for the C++,
arfuse/_vocab_tables.py for the Python package). Unchanged files are not rewritten; generated
files no longer emitted are deleted from --out (files without the generated header are never
touched; nothing under --root is deleted).

Exit status: 0 success, 1 --check found differences, 2 bad input or I/O error (the binary's;
go run ./gen turns every non-zero status into 1).

Flags:
`

// options are the parsed flags.
type options struct {
	matrix string
	out    string
	root   string
	only   []string
	list   bool
	check  bool
	tuning string
	models string
}

func run(args []string, stdout, stderr io.Writer) int {
	var o options
	fs := pflag.NewFlagSet("gen", pflag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.SortFlags = false
	fs.StringVar(&o.matrix, "matrix", "variants/default.yaml", "variant matrix: a YAML file, or a bare name such as ci for variants/ci.yaml")
	fs.StringVar(&o.out, "out", "out", "output directory")
	fs.StringVar(&o.root, "root", ".", "the repository root, where the checked-in vocabulary files are written and checked (\"\": neither)")
	fs.StringArrayVar(&o.only, "only", nil, "keep only variants whose name matches this glob (path.Match; repeatable)")
	fs.BoolVar(&o.list, "list", false, "print the names of the variants it would emit, one per line, and write nothing")
	fs.BoolVar(&o.check, "check", false, "write nothing; exit 1 naming the files that differ, are missing or are extra in --out, or differ or are missing under --root")
	fs.StringVar(&o.tuning, "tuning", "variants/tuning.yaml", "measured one-shot/two-shot thresholds")
	fs.StringVar(&o.models, "models", "variants/models.yaml", "MoE models and their hidden sizes")
	help := fs.BoolP("help", "h", false, "print this help")
	if err := fs.Parse(args); err != nil {
		fmt.Fprintf(stderr, "gen: %v (see --help)\n", err)
		return 2
	}
	if *help {
		fmt.Fprint(stdout, usageHead+fs.FlagUsages())
		return 0
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "gen: unexpected argument %q (see --help)\n", fs.Arg(0))
		return 2
	}
	if o.list && o.check {
		fmt.Fprintln(stderr, "gen: --list and --check cannot be combined")
		return 2
	}
	if err := generate(o, stdout, stderr); err != nil {
		var exit exitError
		if errors.As(err, &exit) {
			return int(exit)
		}
		fmt.Fprintln(stderr, oneLine(err.Error()))
		return 2
	}
	return 0
}

// exitError ends run with a status after the message has been printed.
type exitError int

func (e exitError) Error() string { return fmt.Sprintf("exit %d", int(e)) }

func oneLine(s string) string { return strings.Join(strings.Fields(s), " ") }

// matrixPath turns a bare name (no directory, no extension) into variants/NAME.yaml.
func matrixPath(m string) string {
	if !strings.ContainsAny(m, `/\`) && filepath.Ext(m) == "" {
		return filepath.Join("variants", m+".yaml")
	}
	return m
}

func generate(o options, stdout, stderr io.Writer) error {
	// Model.
	models, err := loadModels(o.models)
	if err != nil {
		return err
	}
	mpath := matrixPath(o.matrix)
	matrix, err := loadMatrix(mpath, models)
	if err != nil {
		return err
	}
	tuning, err := loadTuning(o.tuning)
	if err != nil {
		return err
	}
	// Plan.
	variants, err := expand(matrix)
	if err != nil {
		return err
	}
	if err := checkTuning(tuning); err != nil {
		return err
	}
	variants = splitByTokens(variants, tuning)
	if variants, err = filterOnly(variants, o.only, mpath); err != nil {
		return err
	}
	if o.list {
		for _, v := range variants {
			fmt.Fprintln(stdout, v.Name)
		}
		return nil
	}
	// The vocabulary (vocab.go): the tables alone, whatever the matrix.
	vocab, err := newVocab()
	if err != nil {
		return err
	}
	// Render.
	files, err := render(newGen(filepath.ToSlash(mpath), o.only, variants, tuning))
	if err != nil {
		return err
	}
	vocabOut, err := renderVocab(vocab)
	if err != nil {
		return err
	}
	if o.root != "" {
		if err := checkRoot(o.root, o.out, vocabOut); err != nil {
			return err
		}
	}
	// Write (or compare).
	if o.check {
		changes, err := diff(o.out, files)
		if err != nil {
			return err
		}
		var vocabChanges []Change
		if o.root != "" {
			if vocabChanges, err = diffListed(o.root, vocabOut); err != nil {
				return err
			}
		}
		for _, c := range append(changes, vocabChanges...) {
			fmt.Fprintf(stderr, "%s: %s\n", c.Path, c.What)
		}
		if len(changes) > 0 {
			fmt.Fprintf(stderr, "gen: %s is not what go run ./gen would write (%d files); rerun it\n", o.out, len(changes))
		}
		if len(vocabChanges) > 0 {
			fmt.Fprintf(stderr, "gen: the checked-in vocabulary under %s is not what go run ./gen would write (%d files); rerun it\n", o.root, len(vocabChanges))
		}
		if len(changes)+len(vocabChanges) > 0 {
			return exitError(1)
		}
		return nil
	}
	if _, err = write(o.out, files); err != nil {
		return err
	}
	if o.root != "" {
		_, err = writeListed(o.root, vocabOut)
	}
	return err
}

// checkRoot refuses a --root that is not the repository root (the directories of the checked-in
// files must exist there: a generator run from elsewhere must not start a second tree) and an
// --out that holds the checked-in files (its stale-file sweep would delete them).
func checkRoot(root, out string, files Files) error {
	absOut, err := filepath.Abs(out)
	if err != nil {
		return err
	}
	for _, rel := range sortedPaths(files) {
		dir := filepath.Join(root, filepath.FromSlash(path.Dir(rel)))
		if st, err := os.Stat(dir); err != nil || !st.IsDir() {
			return &InputError{File: "--root", Value: fmt.Sprintf("%q", root),
				Rule: "has no directory " + path.Dir(rel) + "/ for " + rel + ": not the repository root (--root \"\" leaves the checked-in files alone)"}
		}
		abs, err := filepath.Abs(filepath.Join(root, filepath.FromSlash(rel)))
		if err != nil {
			return err
		}
		if r, err := filepath.Rel(absOut, abs); err == nil && r != ".." && !strings.HasPrefix(r, ".."+string(filepath.Separator)) {
			return &InputError{File: "--out", Value: fmt.Sprintf("%q", out),
				Rule: "holds the checked-in " + rel + " (--out is swept for stale generated files): pick a directory of its own"}
		}
	}
	return nil
}

// sortedPaths lists a rendered tree's paths in order.
func sortedPaths(files Files) []string {
	var rels []string
	for p := range files {
		rels = append(rels, p)
	}
	slices.Sort(rels)
	return rels
}

// filterOnly keeps the variants whose name matches one of the globs (all of them when there is
// none). A bad pattern, or patterns that keep nothing, are input errors.
func filterOnly(variants []*Variant, only []string, matrix string) ([]*Variant, error) {
	if len(only) == 0 {
		return variants, nil
	}
	for _, pat := range only {
		if _, err := path.Match(pat, ""); err != nil {
			return nil, &InputError{File: "--only", Value: fmt.Sprintf("%q", pat), Rule: "bad glob: " + err.Error()}
		}
	}
	var kept []*Variant
	for _, v := range variants {
		for _, pat := range only {
			if ok, _ := path.Match(pat, v.Name); ok {
				kept = append(kept, v)
				break
			}
		}
	}
	if len(kept) == 0 {
		return nil, &InputError{File: "--only", Value: fmt.Sprintf("%q", strings.Join(only, " ")), Rule: "matches no variant of " + matrix}
	}
	return kept, nil
}

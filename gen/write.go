package main

// Write: the only step that touches the disk. It writes files whose bytes changed (so make does
// not rebuild what did not), deletes generated files it no longer emits, and with check compares
// instead of writing.
//
// Deletion policy: only files that carry the generated marker (generatedMarker in their first
// 512 bytes) are ever deleted or reported as extra; anything else under the output directory (a
// build's object files, a README) is left alone, so --out pointing at the wrong directory cannot
// destroy hand-written files. The checked-in vocabulary (vocab.go) is written under --root, the
// repository root, with writeListed: only its own files are compared and written, nothing there is
// scanned or deleted.

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
)

// Change is one difference between the rendered tree and the disk.
type Change struct {
	Path string // as shown to the user: the output directory joined with the relative path
	What string // "differs", "missing", "extra"
}

// isGenerated reports whether the file at p starts with the generated marker.
func isGenerated(p string) (bool, error) {
	f, err := os.Open(p)
	if err != nil {
		return false, err
	}
	defer f.Close()
	head := make([]byte, 512)
	n, err := io.ReadFull(f, head)
	if err != nil && !errors.Is(err, io.ErrUnexpectedEOF) && !errors.Is(err, io.EOF) {
		return false, err
	}
	return bytes.Contains(head[:n], []byte(generatedMarker)), nil
}

// normalise checks the rendered paths: clean, relative and distinct once cleaned.
func normalise(files Files) ([]string, error) {
	seen := map[string]string{}
	var rels []string
	for p := range files {
		c := path.Clean(p)
		if c != p || path.IsAbs(p) || c == "." || c == ".." || strings.HasPrefix(c, "../") {
			return nil, fmt.Errorf("refusing to write %q: not a clean relative path", p)
		}
		if other, dup := seen[strings.ToLower(c)]; dup {
			return nil, fmt.Errorf("refusing to write one path twice: %q and %q", other, p)
		}
		seen[strings.ToLower(c)] = p
		rels = append(rels, p)
	}
	slices.Sort(rels)
	return rels, nil
}

// diff compares the rendered tree with dir, including the generated files under dir that the tree
// no longer has ("extra").
func diff(dir string, files Files) ([]Change, error) {
	changes, err := diffListed(dir, files)
	if err != nil {
		return nil, err
	}
	stale, err := staleFiles(dir, files)
	if err != nil {
		return nil, err
	}
	for _, p := range stale {
		changes = append(changes, Change{p, "extra"})
	}
	slices.SortFunc(changes, func(a, b Change) int { return strings.Compare(a.Path, b.Path) })
	return changes, nil
}

// diffListed compares only the rendered files with their copies under dir: for a directory that
// holds far more than the generator's files (the repository root, where the checked-in vocabulary
// lives), which is never scanned for stale ones.
func diffListed(dir string, files Files) ([]Change, error) {
	rels, err := normalise(files)
	if err != nil {
		return nil, err
	}
	var changes []Change
	for _, rel := range rels {
		p := filepath.Join(dir, filepath.FromSlash(rel))
		old, err := os.ReadFile(p)
		switch {
		case errors.Is(err, fs.ErrNotExist):
			changes = append(changes, Change{p, "missing"})
		case err != nil:
			return nil, err
		case !bytes.Equal(old, files[rel]):
			changes = append(changes, Change{p, "differs"})
		}
	}
	return changes, nil
}

// staleFiles lists generated files under dir that are not in files.
func staleFiles(dir string, files Files) ([]string, error) {
	var stale []string
	err := filepath.WalkDir(dir, func(p string, e fs.DirEntry, err error) error {
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) && p == dir {
				return fs.SkipAll
			}
			return err
		}
		if !e.Type().IsRegular() {
			return nil
		}
		rel, err := filepath.Rel(dir, p)
		if err != nil {
			return err
		}
		if _, ok := files[filepath.ToSlash(rel)]; ok {
			return nil
		}
		gen, err := isGenerated(p)
		if err != nil {
			return err
		}
		if gen {
			stale = append(stale, p)
		}
		return nil
	})
	return stale, err
}

// write makes dir hold files: changed and missing files are written (through a temporary file and
// a rename), unchanged ones are not touched, stale generated files are removed, along with the
// directories that this leaves empty. It returns what it changed.
func write(dir string, files Files) ([]Change, error) {
	changes, err := diff(dir, files)
	if err != nil {
		return nil, err
	}
	return changes, apply(dir, files, changes)
}

// writeListed writes the changed and missing files of files under dir and removes nothing (the
// checked-in vocabulary: diffListed).
func writeListed(dir string, files Files) ([]Change, error) {
	changes, err := diffListed(dir, files)
	if err != nil {
		return nil, err
	}
	return changes, apply(dir, files, changes)
}

// apply carries out changes, as diff or diffListed found them.
func apply(dir string, files Files, changes []Change) error {
	for _, c := range changes {
		if c.What == "extra" {
			if err := os.Remove(c.Path); err != nil {
				return err
			}
			removeEmptyParents(dir, filepath.Dir(c.Path))
			continue
		}
		rel, err := filepath.Rel(dir, c.Path)
		if err != nil {
			return err
		}
		if err := writeFile(c.Path, files[filepath.ToSlash(rel)]); err != nil {
			return err
		}
	}
	return nil
}

func writeFile(p string, data []byte) error {
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		return err
	}
	tmp, err := os.CreateTemp(filepath.Dir(p), "."+filepath.Base(p)+".tmp*")
	if err != nil {
		return err
	}
	_, werr := tmp.Write(data)
	cerr := tmp.Close()
	if err := errors.Join(werr, cerr, os.Chmod(tmp.Name(), 0o644)); err != nil {
		os.Remove(tmp.Name())
		return err
	}
	if err := os.Rename(tmp.Name(), p); err != nil {
		os.Remove(tmp.Name())
		return err
	}
	return nil
}

// removeEmptyParents removes d and its parents up to (not including) root while they are empty.
func removeEmptyParents(root, d string) {
	for {
		rel, err := filepath.Rel(root, d)
		if err != nil || rel == "." || rel == ".." || strings.HasPrefix(rel, ".."+string(filepath.Separator)) {
			return
		}
		if os.Remove(d) != nil {
			return
		}
		d = filepath.Dir(d)
	}
}

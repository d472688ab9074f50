package main

// kilnd's config file: TOML whose top-level keys are kilnd's flag names
// (state-dir = "/var/lib/kiln", listen = ["unix:/run/kiln/kilnd.sock"]).
// A key's value goes through its flag's own parsing, so a file can say
// nothing a command line cannot, and flags given on the command line
// override the file's.

import (
	"errors"
	"flag"
	"fmt"
	"os"
	"strconv"
	"time"

	"github.com/BurntSushi/toml"
)

// defaultConfigFile is read when it exists and --config is not given.
const defaultConfigFile = "/etc/kiln/kilnd.toml"

// maxConfigFile bounds what kilnd reads of a config file.
const maxConfigFile = 1 << 20

// ConfigError is a config file's bad key or value, with where it is.
type ConfigError struct {
	File string
	Line int    // 0 when unknown
	Key  string // "" for a syntax error
	Err  error
}

func (e *ConfigError) Error() string {
	where := e.File
	if e.Line > 0 {
		where += ":" + strconv.Itoa(e.Line)
	}
	if e.Key == "" {
		return fmt.Sprintf("config %s: %v", where, e.Err)
	}
	return fmt.Sprintf("config %s: key %q: %v", where, e.Key, e.Err)
}

func (e *ConfigError) Unwrap() error { return e.Err }

// errUnknownKey is a config file key that names no flag.
var errUnknownKey = errors.New("unknown key (the keys are kilnd's flag names; see kilnd -h)")

// applyConfigFile sets fs's flags from the TOML file at path, skipping
// those in skip (the ones the command line sets, which win). Every key
// must name a flag of fs (but "config") and have the type that flag
// takes: a string, a bool, an integer, a number, a duration string
// ("90s"), or for --listen an array of strings.
func applyConfigFile(path string, fs *flag.FlagSet, skip map[string]bool) error {
	f, err := os.Open(path)
	if err != nil {
		return fmt.Errorf("config file: %w", err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return fmt.Errorf("config file: %w", err)
	}
	if !fi.Mode().IsRegular() {
		return fmt.Errorf("config file %s is not a regular file", path)
	}
	if fi.Size() > maxConfigFile {
		return fmt.Errorf("config file %s is %d bytes; at most %d", path, fi.Size(), maxConfigFile)
	}
	b := make([]byte, fi.Size())
	if _, err := f.ReadAt(b, 0); err != nil && fi.Size() > 0 {
		return fmt.Errorf("config file: %w", err)
	}
	return applyConfig(path, string(b), fs, skip)
}

// applyConfig is applyConfigFile over the file's text; name is what
// errors call it.
func applyConfig(name, text string, fs *flag.FlagSet, skip map[string]bool) error {
	var top map[string]toml.Primitive
	md, err := toml.Decode(text, &top)
	if err != nil {
		var pe toml.ParseError
		if errors.As(err, &pe) {
			return &ConfigError{File: name, Line: pe.Position.Line, Key: pe.LastKey, Err: errors.New(pe.Message)}
		}
		return &ConfigError{File: name, Err: err}
	}
	for _, k := range md.Keys() {
		if len(k) != 1 {
			continue // inside a table, refused as the table's key
		}
		key := k[0]
		prim := top[key]
		fl := fs.Lookup(key)
		var v toml.Unmarshaler = rejectValue{errUnknownKey}
		switch {
		case key == "config":
			v = rejectValue{errors.New("a config file cannot name another")}
		case fl != nil && skip[key]:
			continue
		case fl != nil:
			v = fileValue{fs: fs, fl: fl}
		}
		if err := md.PrimitiveDecode(prim, v); err != nil {
			return configError(name, key, err)
		}
	}
	return nil
}

// configError turns a decode error into a ConfigError with its line.
func configError(name, key string, err error) error {
	var pe toml.ParseError
	if errors.As(err, &pe) {
		inner := errors.Unwrap(pe)
		if inner == nil {
			inner = errors.New(pe.Message)
		}
		return &ConfigError{File: name, Line: pe.Position.Line, Key: key, Err: inner}
	}
	return &ConfigError{File: name, Key: key, Err: err}
}

// rejectValue refuses whatever a key holds: an unknown key, whose line
// the decoder then reports.
type rejectValue struct{ err error }

func (r rejectValue) UnmarshalTOML(any) error { return r.err }

// fileValue sets one flag from its TOML value.
type fileValue struct {
	fs *flag.FlagSet
	fl *flag.Flag
}

// tomlType names a decoded TOML value's type for errors.
func tomlType(v any) string {
	switch v := v.(type) {
	case string:
		return fmt.Sprintf("the string %q", v)
	case bool:
		return fmt.Sprintf("the bool %v", v)
	case int64:
		return fmt.Sprintf("the integer %d", v)
	case float64:
		return fmt.Sprintf("the float %v", v)
	case []any:
		return "an array"
	case map[string]any:
		return "a table"
	}
	return fmt.Sprintf("a %T", v)
}

func (f fileValue) UnmarshalTOML(data any) error {
	var want any
	if g, ok := f.fl.Value.(flag.Getter); ok {
		want = g.Get()
	}
	set := func(s string) error { return f.fs.Set(f.fl.Name, s) }
	// The flag package's own values say only "parse error": name the value.
	setStd := func(s string) error {
		if err := set(s); err != nil {
			return fmt.Errorf("%q: %w", s, err)
		}
		return nil
	}
	switch want.(type) {
	case bool:
		b, ok := data.(bool)
		if !ok {
			return fmt.Errorf("want true or false, not %s", tomlType(data))
		}
		return setStd(strconv.FormatBool(b))
	case int, int64, uint, uint64:
		n, ok := data.(int64)
		if !ok {
			return fmt.Errorf("want an integer, not %s", tomlType(data))
		}
		return setStd(strconv.FormatInt(n, 10))
	case float64:
		switch n := data.(type) {
		case float64:
			return set(strconv.FormatFloat(n, 'g', -1, 64))
		case int64:
			return set(strconv.FormatInt(n, 10))
		}
		return fmt.Errorf("want a number, not %s", tomlType(data))
	case time.Duration:
		s, ok := data.(string)
		if !ok {
			return fmt.Errorf(`want a duration string such as "90s" or "2h", not %s`, tomlType(data))
		}
		return setStd(s)
	case []string:
		switch v := data.(type) {
		case string:
			return set(v)
		case []any:
			for i, e := range v {
				s, ok := e.(string)
				if !ok {
					return fmt.Errorf("element %d: want a string, not %s", i, tomlType(e))
				}
				if err := set(s); err != nil {
					return err
				}
			}
			return nil
		}
		return fmt.Errorf("want an array of strings, not %s", tomlType(data))
	}
	if b, ok := data.(bool); ok {
		// A flag of words that also takes a bool (--jail: auto, true,
		// false).
		if bf, isBool := f.fl.Value.(interface{ IsBoolFlag() bool }); isBool && bf.IsBoolFlag() {
			return setStd(strconv.FormatBool(b))
		}
	}
	s, ok := data.(string)
	if !ok {
		return fmt.Errorf("want a string, not %s", tomlType(data))
	}
	return set(s)
}

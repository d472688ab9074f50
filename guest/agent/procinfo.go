package agent

import (
	"errors"
	"math"
	"strconv"
	"strings"
	"time"
)

// parseMeminfo parses /proc/meminfo ("MemTotal:  16318780 kB" lines) into
// byte counts (counts without a unit are kept as they are). Malformed lines
// are skipped.
func parseMeminfo(data []byte) map[string]uint64 {
	out := make(map[string]uint64)
	for line := range strings.Lines(string(data)) {
		name, rest, ok := strings.Cut(line, ":")
		if !ok || name == "" {
			continue
		}
		fields := strings.Fields(rest)
		if len(fields) == 0 {
			continue
		}
		n, err := strconv.ParseUint(fields[0], 10, 64)
		if err != nil {
			continue
		}
		if len(fields) > 1 && fields[1] == "kB" {
			if n > math.MaxUint64/1024 {
				continue
			}
			n *= 1024
		}
		out[name] = n
	}
	return out
}

// parseUptime parses /proc/uptime ("350735.47 234388.90"): the first field,
// seconds with an optional fraction.
func parseUptime(data []byte) (time.Duration, error) {
	fields := strings.Fields(string(data))
	if len(fields) == 0 {
		return 0, errors.New("empty /proc/uptime")
	}
	secs, frac, _ := strings.Cut(fields[0], ".")
	s, err := strconv.ParseUint(secs, 10, 64)
	if err != nil {
		return 0, errors.New("malformed /proc/uptime: " + strconv.Quote(fields[0]))
	}
	if s > uint64(math.MaxInt64/int64(time.Second)) {
		return 0, errors.New("uptime out of range: " + strconv.Quote(fields[0]))
	}
	d := time.Duration(s) * time.Second
	if frac != "" {
		if len(frac) > 9 {
			frac = frac[:9]
		}
		f, err := strconv.ParseUint(frac, 10, 64)
		if err != nil {
			return 0, errors.New("malformed /proc/uptime: " + strconv.Quote(fields[0]))
		}
		for range 9 - len(frac) {
			f *= 10
		}
		if d > math.MaxInt64-time.Duration(f) {
			return 0, errors.New("uptime out of range: " + strconv.Quote(fields[0]))
		}
		d += time.Duration(f)
	}
	return d, nil
}

// parseKeyedCounters parses "name value" lines, as in a cgroup's
// memory.events. Malformed lines are skipped.
func parseKeyedCounters(data []byte) map[string]uint64 {
	out := make(map[string]uint64)
	for line := range strings.Lines(string(data)) {
		fields := strings.Fields(line)
		if len(fields) != 2 {
			continue
		}
		n, err := strconv.ParseUint(fields[1], 10, 64)
		if err != nil {
			continue
		}
		out[fields[0]] = n
	}
	return out
}

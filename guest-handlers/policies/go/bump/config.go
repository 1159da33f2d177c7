// The settings `init` accepts. Every error names the key and says why, as the host
// shows it to whoever configured the policy.

package main

import "strconv"

// name is shown in the host's errors and statistics.
const name = "bump"

// batch lets the host fetch blocks ahead with `malloc-many` and hand frees back later
// with `free-many`. That changes only when the policy sees calls, never what a call
// means: blocks are still found by address and counted per chunk, so it is safe.
const batch = true

// configure applies the key/value pairs; "" when they are all good.
func configure(pairs [][2]string) string {
	size := uint64(1 << 20)
	keep := -1
	seen := map[string]bool{}
	for _, kv := range pairs {
		key, value := kv[0], kv[1]
		if seen[key] {
			return key + ": given twice"
		}
		seen[key] = true
		switch key {
		case "chunk-size":
			n, ok := parseSize(value)
			switch {
			case !ok:
				return "chunk-size: " + strconv.Quote(value) +
					" is not a size (a number of bytes, optionally with K, M or G)"
			case n < 64 || n > 1<<30:
				return "chunk-size: " + value + " is outside 64 bytes..1 GiB"
			case n%16 != 0:
				return "chunk-size: " + value + " is not a multiple of 16, the alignment"
			}
			size = n
		case "idle-chunks":
			if value == "all" {
				keep = -1
				break
			}
			n, err := strconv.ParseUint(value, 10, 31)
			if err != nil {
				return "idle-chunks: " + strconv.Quote(value) + " is not a count (0, 1, 2, ... or all)"
			}
			keep = int(n)
		default:
			return "unknown key " + strconv.Quote(key) + " (bump takes chunk-size, idle-chunks)"
		}
	}
	chunkSize, direct, maxIdle = size, size/4, keep
	return ""
}

// parseSize reads "4096", "64K", "1M", "1MiB", "2g": binary multiples.
func parseSize(s string) (uint64, bool) {
	shift := 0
	digits := s
	for _, unit := range []struct {
		suffix string
		shift  int
	}{{"KiB", 10}, {"MiB", 20}, {"GiB", 30}, {"K", 10}, {"M", 20}, {"G", 30}, {"k", 10}, {"m", 20}, {"g", 30}} {
		if len(s) > len(unit.suffix) && s[len(s)-len(unit.suffix):] == unit.suffix {
			digits, shift = s[:len(s)-len(unit.suffix)], unit.shift
			break
		}
	}
	n, err := strconv.ParseUint(digits, 10, 64)
	if err != nil || n > (1<<40)>>shift {
		return 0, false
	}
	return n << shift, true
}

//go:build race

package jail

// raceEnabled: the race detector links cgo, and a cgo binary cannot enter
// a jail (AllThreadsSyscall), so childBinary builds a child without it.
const raceEnabled = true

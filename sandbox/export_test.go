package sandbox

// WarmSnapshot is warmSnapshot, for the package's external tests.
var WarmSnapshot = warmSnapshot

package sandbox

// WarmSnapshot is warmSnapshot, for the package's external tests.
var WarmSnapshot = warmSnapshot

// ShOut is shOut, for the package's external tests.
var ShOut = shOut

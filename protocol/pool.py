"""The descriptor pool the generated stubs register in.

A private pool rather than protobuf's default one: tritonclient registers the same proto
package and file names, and both sets of stubs must be importable in one process.
"""

from google.protobuf import descriptor_pool

POOL = descriptor_pool.DescriptorPool()

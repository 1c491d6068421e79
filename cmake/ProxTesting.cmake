# SPDX-License-Identifier: Apache-2.0
#! @file cmake/ProxTesting.cmake  Helpers for prox's own ctest entries (not installed).

#[[ prox_add_bad_input_test(NAME <test> MATCH <token> COMMAND <cmd> [args...])
A command-line tool refuses a bad flag or value. The test passes when the output holds one line with
<token> (the flag's name or the bad value, as a regular expression) and an error word (invalid,
unknown, not, expected, must, ...), in either order. Not WILL_FAIL: without a GPU a *valid* flag
exits non-zero too, so an exit code proves nothing in CI. The words cover both the tools' own
messages and CLI11's ("--x: Value 9 not in range ...", "The following arguments were not expected").
Labelled host: no GPU is needed. ]]
function(prox_add_bad_input_test)
  cmake_parse_arguments(PARSE_ARGV 0 arg "" "NAME;MATCH" "COMMAND")
  if(NOT arg_NAME OR NOT arg_MATCH OR NOT arg_COMMAND)
    message(FATAL_ERROR "prox_add_bad_input_test: NAME, MATCH and COMMAND are required")
  endif()
  set(words "[Ii]nvalid|[Uu]nknown|[Nn]ot |[Ee]xpected|[Mm]ust |[Rr]ange|takes|needs|[Rr]equire|[Ii]ncomplete")
  add_test(NAME ${arg_NAME} COMMAND ${arg_COMMAND})
  set_tests_properties(${arg_NAME} PROPERTIES LABELS host
                       PASS_REGULAR_EXPRESSION "(${arg_MATCH})[^\n]*(${words})|(${words})[^\n]*(${arg_MATCH})")
endfunction()

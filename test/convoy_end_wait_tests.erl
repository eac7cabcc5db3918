%% The end of a wait on a lane's alias leaves nothing in the caller's mailbox.
-module(convoy_end_wait_tests).

-include_lib("eunit/include/eunit.hrl").

%% An answer that came in before the wait ended without it is taken out; a later
%% one is dropped by the runtime (the alias is gone).
late_answer_taken_test() ->
    Lane = spawn(fun() -> receive stop -> ok end end),
    Mon = erlang:monitor(process, Lane, [{alias, demonitor}]),
    Mon ! {Mon, room},
    ok = convoy_wait:end_wait(Mon, true),
    Mon ! {Mon, room},
    Lane ! stop,
    ?assertEqual([], element(2, process_info(self(), messages))).

%% A wait that took its answer reads nothing more: other messages stay.
answered_wait_leaves_mailbox_test() ->
    Lane = spawn(fun() -> receive stop -> ok end end),
    Mon = erlang:monitor(process, Lane, [{alias, demonitor}]),
    self() ! {other, 1},
    ok = convoy_wait:end_wait(Mon, false),
    Lane ! stop,
    ?assertEqual([{other, 1}], element(2, process_info(self(), messages))),
    receive {other, 1} -> ok end.

%% A sequence collector for the Common Test suites: senders send `{seq, From, N}'
%% (or `{seq, From, N, Payload}') with N = 1, 2, ... per sender; the collector
%% counts them and records every number that is not the sender's previous one plus
%% one (a reordering, a loss or a duplicate).
-module(convoy_ct_seq).

-export([start/1, collector/0, await/2]).

%% How many errors a report carries.
-define(SHOWN, 10).

%% A collector on Node (which has this module's code).
-spec start(node()) -> pid().
start(Node) ->
    spawn(Node, ?MODULE, collector, []).

-spec collector() -> no_return().
collector() ->
    loop(#{}, 0, [], []).

loop(Last, Count, Errors, Waiters) ->
    receive
        {seq, From, Seq} ->
            seen(From, Seq, Last, Count, Errors, Waiters);
        {seq, From, Seq, _Payload} ->
            seen(From, Seq, Last, Count, Errors, Waiters);
        {'$seq_await', Target, ReplyTo} ->
            answer(Last, Count, Errors, [{Target, ReplyTo} | Waiters])
    end.

seen(From, Seq, Last, Count, Errors, Waiters) ->
    Errors1 = case maps:get(From, Last, 0) of
                  Prev when Seq =:= Prev + 1 -> Errors;
                  Prev -> [{From, Prev, Seq} | Errors]
              end,
    answer(Last#{From => Seq}, Count + 1, Errors1, Waiters).

answer(Last, Count, Errors, Waiters) ->
    {Done, Left} = lists:partition(fun({T, _}) -> Count >= T end, Waiters),
    [R ! {'$seq_count', self(), Count, lists:sublist(lists:reverse(Errors), ?SHOWN)}
     || {_, R} <- Done],
    loop(Last, Count, Errors, Left).

%% @doc `{Count, FirstErrors}' once the collector holds at least Target messages;
%% fails the test case after 30 s.
-spec await(pid(), non_neg_integer()) -> {non_neg_integer(), list()}.
await(C, Target) ->
    C ! {'$seq_await', Target, self()},
    receive {'$seq_count', C, N, Errors} -> {N, Errors}
    after 30000 -> ct:fail({collector_short, C, Target})
    end.

%% @private
%% The plain sends of a batch: entries `{To, Msg}' to a name, or to a pid of the
%% receiving node of its current incarnation, which need no other check and
%% rebuild nothing. The inbox's core asks for a run of them and the inbox sends it
%% in the walk that checks it (`run/5' with `send'); the core and the tests count
%% with the same rule (`count').
-module(convoy_plain).

-export([run/5]).

%% @doc The plain sends at the head of a batch's `Entries', at most `Max' of them:
%% entries `{To, Msg}' to a name or to a pid of this node (`Local') of its current
%% incarnation (`Good', one already found so, or any that
%% `convoy_wire:current_by_form/1' tells current). Each passes
%% `convoy_wire:entry/3' as `{deliver, To, Msg}' and costs
%% `convoy_wire:send_cost/0'. With `send', each is also sent as it is checked, as
%% `!' sends it (a name nobody holds drops its message, counted in `Dropped'): a
%% second walk cost each message a function call and a reduction
%% (doc/decisions.md, "An inbox sends a plain run in the walk that checks it").
%% With `count', nothing is sent. Answers how many, the entries after them, the
%% last pid among them (`Good' if none) and `Dropped'.
-spec run(list(), non_neg_integer(), term(), node(), send | count) ->
          {non_neg_integer(), list(), term(), non_neg_integer()}.
run(Entries, Max, Good, Local, How) ->
    run(Entries, Max, Good, Local, How, 0, 0).

run([{To, Msg} | Rest] = Entries, Max, Good, Local, How, K, Dropped)
  when K < Max, is_pid(To), node(To) =:= Local ->
    case To =:= Good orelse convoy_wire:current_by_form(To) of
        true ->
            case How of
                send -> To ! Msg;
                count -> ok
            end,
            run(Rest, Max, To, Local, How, K + 1, Dropped);
        false ->
            {K, Entries, Good, Dropped}
    end;
run([{To, Msg} | Rest], Max, Good, Local, How, K, Dropped)
  when K < Max, is_atom(To), To =/= undefined ->
    Dropped1 = case How of
                   send ->
                       try To ! Msg of
                           _ -> Dropped
                       catch
                           error:badarg -> Dropped + 1 % nobody holds the name
                       end;
                   count ->
                       Dropped
               end,
    run(Rest, Max, Good, Local, How, K + 1, Dropped1);
run(Entries, _Max, Good, _Local, _How, K, Dropped) ->
    {K, Entries, Good, Dropped}.
